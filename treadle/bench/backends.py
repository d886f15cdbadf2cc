"""Offline backends run side by side on one workload: Treadle (continuous
batching, chunked prefill; with ``--speculative-config`` it speculates, ``treadle-nospec``
is the same engine without), Treadle in static batches, Hugging Face
transformers generate() and llama.cpp (through llama-cpp-python, in llamacpp.py; its
prompt-lookup decoding, batch 1 only, in llamacpp_lookup.py; llama.cpp's own llama-server
with one slot per concurrent request, built by tools/build_llamacpp.sh, in llamacpp_server.py).

Every backend runs greedy decoding with EOS ignored, so each request yields
exactly its ``output_len`` tokens, and reports a RequestRecord per request
(one chunk per token) with all requests handed over at the run's start.
``concurrency`` means: Treadle keeps at most that many requests in the engine
(a new one enters as soon as one finishes); the static peers cut the workload
into fixed batches of that size and run each batch to completion.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from treadle.bench import BACKENDS, BenchError
from treadle.bench.metrics import KVWaste, RequestRecord, RunResult
from treadle.bench.roofline import decode_weight_bytes
from treadle.bench.workloads import BenchRequest

Progress = Callable[[int], Any] | None  # called with the number of requests just finished



class Backend(Protocol):
    name: str

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of weights read per decode step, when known (read-only: a backend may hold an int)."""
        ...

    def run(self, reqs: list[BenchRequest], concurrency: int, progress: Progress = None) -> RunResult:
        """Run every request (greedy, exactly ``output_len`` tokens each) with at most
        ``concurrency`` in flight; all are handed over at the start of the run."""
        ...


def kv_occupancy(engine: Any) -> tuple[int, int]:
    """(allocated, used) KV slots over the running requests; a block shared by
    several requests (prefix cache) counts once, filled as its fullest user sees it."""
    kv = engine.kv_manager
    bs = kv.block_size
    filled: dict[int, int] = {}
    for req in engine.scheduler.running:
        for i, block in enumerate(kv.block_ids(req.request_id)):
            tokens = min(bs, max(0, req.num_computed_tokens - i * bs))
            filled[block] = max(filled.get(block, 0), tokens)
    return len(filled) * bs, sum(filled.values())


class TreadleBackend:
    """Treadle's engine. ``continuous=False`` gives the static peer: chunked
    prefill off, and each batch of ``concurrency`` requests runs to completion
    before the next one is admitted."""

    def __init__(self, engine_kwargs: dict[str, Any], continuous: bool = True) -> None:
        from treadle.engine.llm_engine import LLMEngine

        kw = dict(engine_kwargs)
        kw["enable_chunked_prefill"] = continuous and kw.get("enable_chunked_prefill", True)
        model = kw.pop("model")
        self.engine = LLMEngine.from_args(model, **kw)
        self.continuous = continuous
        self.name = "treadle" if continuous else "static"
        local = self.engine.config.parallel.distributed_executor_backend == "uni"  # weights visible in this process
        self.weight_bytes = decode_weight_bytes(self.engine.model_runner().model) if local else 0
        self._ids = itertools.count()

    def run(self, reqs: list[BenchRequest], concurrency: int, progress: Progress = None) -> RunResult:
        from treadle.sampling_params import SamplingParams

        engine, kv = self.engine, KVWaste(total_slots=self.engine.config.cache.num_tokens)
        pending = list(reversed(reqs))
        records: dict[str, RequestRecord] = {}
        in_flight: set[str] = set()
        t0 = time.perf_counter()
        while pending or in_flight:
            room = concurrency - len(in_flight) if (self.continuous or not in_flight) else 0
            for _ in range(min(room, len(pending))):
                req = pending.pop()
                rid = f"bench-{next(self._ids)}"
                params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
                records[rid] = RequestRecord(req.prompt_len, time.perf_counter())
                engine.add_request(rid, {"prompt_token_ids": req.prompt_token_ids}, params)
                in_flight.add(rid)
            outputs = engine.step()
            now = time.perf_counter()
            kv.observe(*kv_occupancy(engine))
            for out in outputs:
                rec = records[out.request_id]
                rec.chunk_times.extend([now] * len(out.outputs[0].new_token_ids))
                if out.finished:
                    in_flight.discard(out.request_id)
                    if progress:
                        progress(1)
        return RunResult(list(records.values()), time.perf_counter() - t0, kv)


class _StepClock:
    """A transformers streamer that only notes when each generated step arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:  # first call carries the prompt
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFBackend:
    """transformers ``generate()`` on the same weights (a GGUF is dequantized by
    transformers), static left-padded batches, greedy, dtype as Treadle's."""

    name = "hf"

    def __init__(self, model: str, dtype: str = "float32") -> None:
        import transformers

        from treadle.loaders import parse_dtype
        from treadle.loaders.resolve import resolve_model

        path = resolve_model(model)
        kw: dict[str, Any] = {"dtype": parse_dtype(dtype)}
        if path.suffix == ".gguf":
            kw["gguf_file"] = path.name
            path = path.parent
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
        self.weight_bytes = decode_weight_bytes(self.model)

    @torch.inference_mode()
    def run(self, reqs: list[BenchRequest], concurrency: int, progress: Progress = None) -> RunResult:
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        for i in range(0, len(reqs), concurrency):
            batch = reqs[i : i + concurrency]
            width = max(r.prompt_len for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, r in enumerate(batch):  # left padding
                ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.prompt_len :] = 1
            n_new = max(r.output_len for r in batch)
            clock, start = _StepClock(), time.perf_counter()
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                do_sample=False, pad_token_id=0, streamer=clock)
            for r in batch:
                records.append(RequestRecord(r.prompt_len, start, clock.times[: r.output_len]))
            if progress:
                progress(len(batch))
        return RunResult(records, time.perf_counter() - t0)


def make_backend(name: str, engine_kwargs: dict[str, Any], n_ctx: int) -> Backend:
    """``name`` is a backend, optionally with a Treadle quantization after a '+'
    (``treadle+gguf`` keeps a GGUF's 4-bit blocks, ``static+int8``, ...) and another checkpoint
    of the same vocabulary after an '@' (``treadle@quantized/smollm2-w8a8``: a quantized
    checkpoint beside its float model in one run)."""
    spec, _, other_model = name.partition("@")
    base, _, quant = spec.partition("+")
    if other_model:
        if base not in ("treadle", "treadle-nospec", "static"):
            raise BenchError(f"backend {name!r}: only treadle and static take an @MODEL")
        engine_kwargs = dict(engine_kwargs, model=other_model)
    if base in ("treadle", "treadle-nospec", "static"):
        kw = dict(engine_kwargs, quantization=quant) if quant else dict(engine_kwargs)
        if base == "treadle-nospec":  # beside "treadle" with --speculative-config: off vs on in one run
            kw["speculative_config"] = None
        backend = TreadleBackend(kw, continuous=base != "static")
        backend.name = name
        return backend
    if quant:
        raise BenchError(f"backend {name!r}: only treadle and static take a +QUANTIZATION")
    if base == "hf":
        return HFBackend(engine_kwargs["model"], engine_kwargs.get("dtype", "float32"))
    if base == "llamacpp":
        from treadle.bench.llamacpp import LlamaCppBackend

        return LlamaCppBackend(engine_kwargs["model"], n_ctx)
    if base == "llamacpp-server":  # llama.cpp's own server, -np = the concurrency (llamacpp_server.py)
        from treadle.bench.llamacpp_server import make_server_backend

        return make_server_backend(engine_kwargs["model"], n_ctx)
    if base in ("llamacpp-lookup", "llamacpp-hl"):
        from treadle.bench.llamacpp_lookup import LlamaCppLookupBackend

        return LlamaCppLookupBackend(engine_kwargs["model"], n_ctx, engine_kwargs.get("speculative_config"),
                                     lookup=base == "llamacpp-lookup")
    raise BenchError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)} "
                     "(treadle/static take +QUANT and @MODEL)")
