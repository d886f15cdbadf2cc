"""llama.cpp's prompt-lookup decoding as a peer for speculative decoding (issue 12).

llama-cpp-python offers it only in its high-level ``Llama`` API, one sequence at a time:
``Llama(draft_model=LlamaPromptLookupDecoding(...))`` drafts by matching the last n-gram
against the context and verifies the drafts in one ``llama_decode``. So this backend runs
batch 1 only (``--concurrency 1``, the latency bench). ``llamacpp-lookup`` speculates;
``llamacpp-hl`` is the same API without a draft model, so the pair's ratio is llama.cpp's
own gain from prompt lookup, beside Treadle's ``treadle-nospec`` / ``treadle`` pair.

The draft length and the longest n-gram come from ``--speculative-config``
(``num_speculative_tokens``, ``prompt_lookup_max``) so both engines draft alike. Greedy
(temperature 0), EOS banned, exactly ``output_len`` tokens per request, one record chunk per
token as the generator yields it (several tokens of one verify arrive together).
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch

from treadle.bench import BenchError
from treadle.bench.llamacpp import open_peer
from treadle.bench.metrics import RequestRecord, RunResult
from treadle.bench.workloads import BenchRequest


class LlamaCppLookupBackend:
    batch1_only = True

    def __init__(self, model: str, n_ctx: int, speculative_config: str | dict[str, Any] | None, lookup: bool) -> None:
        self.name = "llamacpp-lookup" if lookup else "llamacpp-hl"
        llama_cpp, path = open_peer(self.name, model)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        spec = json.loads(speculative_config) if isinstance(speculative_config, str) else speculative_config or {}
        draft = LlamaPromptLookupDecoding(max_ngram_size=int(spec.get("prompt_lookup_max", 4)),
                                          num_pred_tokens=int(spec.get("num_speculative_tokens", 4)))
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), n_batch=512,
                                   draft_model=draft if lookup else None, verbose=False)
        self.eos = self.llm.token_eos()
        self.weight_bytes = path.stat().st_size
        self._lib = llama_cpp

    def _ban_eos(self, _ids: Any, scores: np.ndarray) -> np.ndarray:
        scores[self.eos] = -np.inf
        return scores

    def run(self, reqs: list[BenchRequest], concurrency: int, progress: Any = None) -> RunResult:
        if concurrency != 1:
            raise BenchError(f"{self.name} decodes one sequence at a time: use --concurrency 1")
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        for req in reqs:
            rec = RequestRecord(req.prompt_len, time.perf_counter())
            gen = self.llm.generate(list(req.prompt_token_ids), top_k=1, temp=0.0, reset=True,
                                    logits_processor=self._lib.LogitsProcessorList([self._ban_eos]))
            for _ in gen:
                rec.chunk_times.append(time.perf_counter())
                if len(rec.chunk_times) == req.output_len:
                    break
            gen.close()
            records.append(rec)
            if progress:
                progress(1)
        return RunResult(records, time.perf_counter() - t0)
