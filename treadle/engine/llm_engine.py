"""LLMEngine: one step loop over the scheduler (LLM Manager) and the model
runner (Text Generator). Synchronous; the async engine and the server drive it."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from treadle.config import CacheConfig, EngineConfig, SchedulerConfig, TreadleError
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.outputs import SchedulerOutput
from treadle.core.request import Request, RequestStatus
from treadle.core.scheduler import Scheduler
from treadle.engine.memory import available_memory, fmt_bytes, plan_kv_cache, weight_bytes
from treadle.engine.output_processor import OutputProcessor
from treadle.engine.outputs import RequestOutput
from treadle.layers.attention.selector import select_backend
from treadle.loaders import load_model, open_model_source, parse_dtype
from treadle.sampling_params import SamplingParams
from treadle.worker.cuda_graph import maybe_graph_runner
from treadle.worker.model_runner import ModelRunner, allocate_kv_cache

logger = logging.getLogger("treadle")

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = torch.device(config.device)
        dtype = parse_dtype(config.dtype)
        source = open_model_source(config.model)
        source_cfg = source.config
        weights = weight_bytes(source_cfg, dtype)
        if source.raw_weights is not None and config.quantization in ("auto", "gguf") and device.type == "cpu":
            weights = source.path.stat().st_size  # native GGUF: the blocks stay as the file has them
        max_model_len = min(config.scheduler.max_model_len or source_cfg.max_position_embeddings,
                            source_cfg.max_position_embeddings)
        sched_cfg = replace(config.scheduler, max_model_len=max_model_len,
                            max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens,
                                                       1 if config.scheduler.enable_chunked_prefill
                                                       else max_model_len))
        plan = plan_kv_cache(source_cfg, config.cache, dtype, max_model_len, sched_cfg.max_num_seqs,
                             available_memory(device), weights, device.type == "cpu")
        backend = select_backend(config.attention_backend, device)
        torch.manual_seed(config.seed)
        loaded = load_model(config.model, backend, dtype, device, config.quantization)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%s), attention backend %s",
                    plan.num_blocks, plan.block_size, plan.num_tokens, fmt_bytes(plan.total_bytes), backend.name)
        self.kv_plan = plan
        self.scheduler_config = sched_cfg
        self.kv_manager = KVCacheManager(plan.num_blocks, plan.block_size)
        self.scheduler = Scheduler(sched_cfg, self.kv_manager)
        kv = allocate_kv_cache(self.model_config, plan.num_blocks, plan.block_size, dtype, device)
        graphs = maybe_graph_runner(config.enforce_eager, device, loaded.model, kv, sched_cfg.max_num_seqs,
                                    -(-max_model_len // plan.block_size), plan.block_size)
        if graphs is not None:
            graphs.capture()
        self.runner = ModelRunner(loaded.model, kv, plan.block_size, sched_cfg.max_num_batched_tokens,
                                  max_model_len, device, config.seed, graphs)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.stats = EngineStats()

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(build_engine_config(model, **kwargs))

    # -- requests --------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        return None, list(prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.parents:
            raise TreadleError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise TreadleError(f"prompt token ids must be in [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, max_len - len(ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        reqs = [Request(cid, ids, params, max_tokens, self.model_config.stop_token_ids, arrival, priority,
                        wait_for=child_ids[0] if i else None, seed_offset=i)
                for i, cid in enumerate(child_ids)]
        self.scheduler.check_admissible(reqs[0])
        self.outputs.add(request_id, text, ids, params, child_ids, arrival)
        for req in reqs:
            self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: list[str] | str) -> None:
        for pid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.outputs.parents.get(pid)
            if parent is None:
                continue
            for cid in parent.children:
                req = self.scheduler.requests.get(cid)
                if req is not None:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    self.outputs.finish_child(req)
            self.outputs.make_output(pid)  # drops the finished parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.parents)

    # -- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        touched = self.scheduler.update_from_output(sched, result)
        self.stats.record(sched, touched)
        updated = self.outputs.process(
            touched, result, lambda req: self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        )
        return [self.outputs.make_output(pid) for pid in updated]


class EngineStats:
    """Counters the metrics endpoint and benchmarks read."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_tokens_computed = 0  # tokens run through the model (prompt, recompute, decode)
        self.num_generated_tokens = 0

    def record(self, sched: SchedulerOutput, touched: list[Request]) -> None:
        self.num_steps += 1
        self.num_preemptions += sched.num_preemptions
        self.num_generated_tokens += len(touched)
        self.num_tokens_computed += sched.total_num_scheduled_tokens


def build_engine_config(
    model: str,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    enable_chunked_prefill: bool = True,
    kv_cache_memory: int | str | None = None,
    num_kv_blocks: int | None = None,
    block_size: int = 16,
    attention_backend: str = "auto",
    quantization: str | None = "auto",
    enforce_eager: bool = False,
) -> EngineConfig:
    return EngineConfig(
        model=model, dtype=dtype, device=device, seed=seed, attention_backend=attention_backend,
        quantization=quantization, enforce_eager=enforce_eager,
        cache=CacheConfig(block_size=block_size, kv_cache_memory=parse_bytes(kv_cache_memory),
                          num_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len or 0, enable_chunked_prefill=enable_chunked_prefill),
    )


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_bytes(value: int | str | None) -> int | None:
    """'2GiB', '512MB', '1e9' or an int -> bytes."""
    if value is None or isinstance(value, int):
        return value
    s = value.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise TreadleError(f"cannot read memory size {value!r}; write e.g. 2GiB or 512MiB")
    return int(float(num) * _UNITS[unit])
