"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from treadle.engine.args import EngineArgs
from treadle.engine.llm_engine import LLMEngine, PromptType
from treadle.engine.outputs import RequestOutput
from treadle.sampling_params import SamplingParams


class LLM:
    """An engine for offline batches. Keyword arguments are ``EngineArgs`` fields, named as
    vLLM's ``LLM``: dtype, max_model_len, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, seed, device, distributed_executor_backend, ..."""

    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_args(model, **kwargs)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's workers now (they also stop when the LLM is collected or at exit)."""
        self.engine.shutdown()

    def get_tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids.append(str(next(self._ids)))
            self.engine.add_request(ids[-1], prompt, p, priority=priority[i] if priority else 0)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        texts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        prompts = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each step the request advances (``new_text`` holds the delta).
        Other requests already in the engine keep running alongside."""
        rid = str(next(self._ids))
        self.engine.add_request(rid, prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)
