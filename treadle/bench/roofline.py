"""Roofline: what this machine could do at best, and how close a run came.

Measured at the start and again at the end of a run, keeping the better of
the two (a machine shared with other jobs only ever makes a peak look lower):
- memory bandwidth: best of 10 sums of a 128 MiB float32 tensor (reads only,
  as decode reads weights), with torch's threads;
- matmul rate: best of 10 1024x1024 @ 1024x1024 products in the model's dtype.

Model (per token, ``L`` = tokens of context it attends to):
- FLOPs = 2 x (linear weights of the layers) + 4 x layers x L x (heads x head_dim),
  plus 2 x lm_head weights for a token whose logits are needed (every decode
  token, only the last token of a prompt)
- KV bytes = 2 (K and V) x layers x kv_heads x head_dim x element size

Bounds:
- decode at batch ``b``: one step reads the weights once plus every sequence's KV:
  step time >= max((W + b x L x kv_bytes) / BW, b x FLOPs(L) / peak),
  so tokens/s <= b / that;
- prefill of ``P`` tokens: time >= max(W / BW, (P x FLOPs(P/2) + lm_head FLOPs) / peak).
- a whole offline workload at concurrency ``c`` (throughput runs): the sum of
  its prefill bounds, plus total_output / c decode steps at batch ``c`` and the
  mean decode context. The "fraction" printed is bound time / measured time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from treadle.bench.workloads import BenchRequest


@dataclass(frozen=True)
class MachinePeaks:
    mem_bandwidth: float  # bytes/s, read
    matmul_flops: float  # FLOP/s in ``dtype``
    dtype: str
    threads: int


def _best_time(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_machine(dtype: torch.dtype = torch.float32, repeats: int = 10) -> MachinePeaks:
    big = torch.ones(32 << 20, dtype=torch.float32)  # 128 MiB
    bw = big.numel() * big.element_size() / _best_time(big.sum, repeats)
    n = 1024
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    flops = 2 * n**3 / _best_time(lambda: torch.mm(a, b), repeats)
    return MachinePeaks(bw, flops, str(dtype).removeprefix("torch."), torch.get_num_threads())


def remeasure(peaks: MachinePeaks) -> MachinePeaks:
    """Measure again and keep the better value of each peak."""
    again = measure_machine(getattr(torch, peaks.dtype))
    return MachinePeaks(max(peaks.mem_bandwidth, again.mem_bandwidth), max(peaks.matmul_flops, again.matmul_flops),
                        peaks.dtype, peaks.threads)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer once
    (shared tensors once), without the rotary tables and without the input
    embedding when a separate lm_head exists (only a few rows of it are read)."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    has_lm_head = any("lm_head" in name for name, _ in named)
    seen: set[int] = set()
    total = 0
    for name, t in named:
        if "rotary" in name or "inv_freq" in name or (has_lm_head and "embed_tokens" in name):
            continue
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class ModelShape:
    linear_params: int  # weights of the layers' matmuls (lm_head apart)
    num_layers: int
    q_width: int  # heads x head_dim
    kv_bytes_per_token: int
    lm_head_params: int = 0

    @staticmethod
    def from_config(cfg, kv_elem_bytes: int = 4) -> ModelShape:  # noqa: ANN001 - treadle.config.ModelConfig
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
        return ModelShape(cfg.num_layers * per_layer, cfg.num_layers, q, 2 * cfg.num_layers * kv * kv_elem_bytes,
                          cfg.vocab_size * h)

    def flops_per_token(self, context: float, logits: bool = True) -> float:
        head = 2.0 * self.lm_head_params if logits else 0.0
        return 2.0 * self.linear_params + 4.0 * self.num_layers * context * self.q_width + head


@dataclass(frozen=True)
class Roofline:
    peaks: MachinePeaks
    shape: ModelShape
    weight_bytes: int

    def decode_step_time(self, batch: int, context: float) -> float:
        mem = (self.weight_bytes + batch * context * self.shape.kv_bytes_per_token) / self.peaks.mem_bandwidth
        return max(mem, batch * self.shape.flops_per_token(context) / self.peaks.matmul_flops)

    def decode_tokens_per_s(self, batch: int, context: float) -> float:
        return batch / self.decode_step_time(batch, context)

    def prefill_time(self, prompt_len: int) -> float:
        flops = prompt_len * self.shape.flops_per_token(prompt_len / 2, logits=False) + 2.0 * self.shape.lm_head_params
        compute = flops / self.peaks.matmul_flops
        return max(self.weight_bytes / self.peaks.mem_bandwidth, compute)

    def prefill_tokens_per_s(self, prompt_len: int) -> float:
        return prompt_len / self.prefill_time(prompt_len)

    def workload_time(self, reqs: list[BenchRequest], concurrency: int) -> float:
        """A lower bound on the wall time of an offline run (see module doc)."""
        prefill = sum(self.prefill_time(r.prompt_len) for r in reqs)
        total_out = sum(r.output_len for r in reqs)
        mean_ctx = sum((r.prompt_len + r.output_len / 2) * r.output_len for r in reqs) / max(1, total_out)
        batch = max(1, min(concurrency, len(reqs)))
        return prefill + (total_out / batch) * self.decode_step_time(batch, mean_ctx)
