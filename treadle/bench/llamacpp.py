"""The llama.cpp peer, through llama-cpp-python's low-level API on the same GGUF.

llama-cpp-python's high-level ``Llama`` decodes one sequence at a time, which
would make any comparison under concurrency meaningless. So this backend
drives ``llama_decode`` the way llama.cpp's own server does with ``-np N``
parallel slots: one context whose KV cache holds N sequences, and each step
one batch with a decode token for every generating slot plus prompt chunks of
slots still prefilling (up to ``n_batch`` tokens), greedy argmax on the CPU.
A new request takes a slot as soon as one frees (continuous batching).
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treadle.bench.metrics import RequestRecord, RunResult
from treadle.bench.workloads import BenchRequest

N_BATCH = 512


def open_peer(backend: str, model: str) -> tuple[Any, Path]:
    """llama-cpp-python and ``model``'s GGUF file, or a RuntimeError saying which is missing."""
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(f"{backend} needs llama-cpp-python: pip install 'treadle[peers]'") from e
    from treadle.loaders.resolve import resolve_model

    path = resolve_model(model)
    if path.suffix != ".gguf":
        raise RuntimeError(f"{backend} needs a GGUF file; {path} is not one")
    return llama_cpp, path


@dataclass
class _Slot:
    req: BenchRequest
    rec: RequestRecord
    pos: int = 0  # tokens already in this sequence's KV
    generated: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.pos < self.req.prompt_len


class LlamaCppBackend:
    name = "llamacpp"

    def __init__(self, model: str, n_ctx: int, n_threads: int | None = None) -> None:
        llama_cpp, path = open_peer(self.name, model)
        self.lib = llama_cpp
        self.threads = n_threads or torch.get_num_threads()
        self.n_ctx = n_ctx
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=self.threads, n_batch=N_BATCH,
                                   verbose=False)  # owns the model; its own context stays unused
        self.model = self.llm._model.model
        self.n_vocab = self.llm.n_vocab()
        self.eos = self.llm.token_eos()
        self.weight_bytes = path.stat().st_size

    def _new_context(self, n_seq: int):  # noqa: ANN202
        L = self.lib
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = self.n_ctx * n_seq, N_BATCH, N_BATCH, n_seq
        p.n_threads = p.n_threads_batch = self.threads
        p.kv_unified = True
        ctx = L.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def run(self, reqs: list[BenchRequest], concurrency: int, progress=None):  # noqa: ANN001, ANN201
        L = self.lib
        ctx = self._new_context(concurrency)
        batch = L.llama_batch_init(N_BATCH, 0, 1)
        pending = list(reversed(reqs))
        slots: dict[int, _Slot] = {}
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        try:
            while pending or slots:
                for sid in range(concurrency):
                    if sid not in slots and pending:
                        req = pending.pop()
                        slots[sid] = _Slot(req, RequestRecord(req.prompt_len, time.perf_counter()))
                rows = self._fill_batch(batch, slots)
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed (KV cache full?)")
                now = time.perf_counter()
                for sid, row in rows.items():
                    slot = slots[sid]
                    slot.generated.append(self._argmax(ctx, row))
                    slot.rec.chunk_times.append(now)
                    if len(slot.generated) == slot.req.output_len:
                        L.llama_memory_seq_rm(L.llama_get_memory(ctx), sid, -1, -1)
                        records.append(slots.pop(sid).rec)
                        if progress:
                            progress(1)
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
        return RunResult(records, time.perf_counter() - t0)

    def _fill_batch(self, batch, slots: dict[int, _Slot]) -> dict[int, int]:  # noqa: ANN001
        """Decode tokens first, then prompt chunks; returns slot -> batch row whose logits to sample."""
        n, rows = 0, {}
        order = sorted(slots, key=lambda s: slots[s].prefilling)  # generating slots first
        for sid in order:
            slot = slots[sid]
            if slot.prefilling:
                take = min(slot.req.prompt_len - slot.pos, N_BATCH - n)
                tokens = slot.req.prompt_token_ids[slot.pos : slot.pos + take]
            else:
                take, tokens = 1, slot.generated[-1:]
            if take <= 0:
                break
            for j, tok in enumerate(tokens):
                batch.token[n + j], batch.pos[n + j] = tok, slot.pos + j
                batch.n_seq_id[n + j], batch.seq_id[n + j][0], batch.logits[n + j] = 1, sid, False
            slot.pos += take
            if not slot.prefilling:  # its last prompt token or a decode token: sample from it
                batch.logits[n + take - 1] = True
                rows[sid] = n + take - 1
            n += take
        batch.n_tokens = n
        return rows

    def _argmax(self, ctx, row: int) -> int:  # noqa: ANN001
        ptr = self.lib.llama_get_logits_ith(ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        logits = logits.copy()
        logits[self.eos] = -np.inf  # EOS ignored, as in every backend
        return int(logits.argmax())
