"""``treadle doctor``: what Treadle's CPU kernels do on this machine, in one report.

    cpu          model name, the SIMD features the kernels look at, logical CPUs, torch threads
    kernels      the variant chosen and why (or TREADLE_CPU_KERNELS's), every variant with what it lacks
    self-tests   every variant this CPU runs against the plain-C build, by its accuracy contract
                 (treadle/kernels/selftest.py): pass / fail with the max error and the bound
    machine      read bandwidth and torch's float32 matmul (bench/roofline.py's measure_machine),
                 and the chosen build's int8 and float32 instruction peaks (kernels/csrc/peak.c)
    decode       the median engine step of ``batch`` sequences decoding together, for batch 1 / 4 / 16,
                 through the public engine API (add_request, step), and each one's ratio to batch 1

It lives with the benchmarks because it runs the engine (entrypoints' LLM); the checks it runs
are the kernels' own (kernels/selftest.py) and the roofline's. Every figure is the best (peaks)
or the median (steps) of a few runs: a shared machine only ever makes a peak look lower.
"""
from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from treadle import envs
from treadle.bench.roofline import measure_machine
from treadle.kernels import native, selftest
from treadle.loaders import huge_pages

BATCHES = (1, 4, 16)
SIMD_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4_2")


def cpu_info() -> dict[str, Any]:
    model = native.cpuinfo().get("model name") or platform.processor() or platform.machine()
    return {"model": model, "features": sorted(f for f in native.cpu_features() if f.startswith(SIMD_PREFIXES)),
            "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads()}


def small_batch_path() -> str:
    """Which code takes small 8-bit batches in the AVX-512 builds, and why (TREADLE_SMALL_BATCH_PATH)."""
    forced = envs.small_batch_path()
    if forced is not None:
        return f"{forced}-bit (forced by TREADLE_SMALL_BATCH_PATH)"
    if native.prefers_256_bit_small_batches():
        return "256-bit register paths up to 4 rows (auto: AMD Zen 4)"
    return "512-bit strips (auto)"


def kernel_info() -> dict[str, Any]:
    return {"selected": native.selected_variant(), "why": native.describe(), "override": envs.cpu_kernels(),
            "small_batches": small_batch_path(), "weights_in_huge_pages": huge_pages.describe(),
            "variants": {v.name: {"runnable": not native.missing_features(v.name),
                                  "lacks": list(native.missing_features(v.name)),
                                  "rounds_activations_to_bf16": native.rounds_activations_to_bf16(v.name)}
                         for v in native.VARIANTS}}


def self_tests() -> list[dict[str, Any]]:
    return [{**asdict(c), "passed": c.passed} for v in selftest.runnable_variants() for c in selftest.run(v)]


def _peak(lib: ctypes.CDLL, kind: str, repeats: int = 5) -> tuple[float, str]:
    fn, name = getattr(lib, f"tq_peak_{kind}"), getattr(lib, f"tq_peak_{kind}_name")
    fn.argtypes, fn.restype, name.restype = [ctypes.c_int64], ctypes.c_double, ctypes.c_char_p
    fn(100_000)  # warm up (clock, threads)
    return max(fn(1_000_000) for _ in range(repeats)), name().decode()


def machine_peaks() -> dict[str, Any]:
    roof = measure_machine(torch.float32, repeats=5)
    out: dict[str, Any] = {"read_bandwidth_gb_s": roof.mem_bandwidth / 1e9,
                           "torch_f32_matmul_gflop_s": roof.matmul_flops / 1e9}
    lib = native.library()
    if lib is not None:
        (i8, i8_name), (f32, f32_name) = _peak(lib, "int8"), _peak(lib, "f32")
        out.update(int8_peak_gop_s=i8 / 1e9, int8_instruction=i8_name, f32_peak_gflop_s=f32 / 1e9,
                   f32_instruction=f32_name)
    return out


def _decode_step_ms(engine: Any, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    from treadle import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [engine.add_request(f"doctor-{batch}-{i}",
                              {"prompt_token_ids": [(7 + 13 * i + j) % (vocab - 2) + 2 for j in range(prompt_len)]},
                              params) for i in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunks, if the token budget splits it), up to each first token
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request(ids)
    return statistics.median(times) * 1e3


def decode_steps(model: str, prompt_len: int = 64, steps: int = 16) -> dict[str, Any]:
    """Median decode step (ms) at each of BATCHES, one engine, ``prompt_len`` tokens of context."""
    from treadle import LLM

    llm = LLM(model, kv_cache_memory="256MiB")
    try:
        vocab = llm.engine.model_config.vocab_size
        _decode_step_ms(llm.engine, 1, prompt_len, 2, vocab)  # warm up
        ms = {b: _decode_step_ms(llm.engine, b, prompt_len, steps, vocab) for b in BATCHES}
    finally:
        llm.engine.shutdown()
    return {"model": model, "prompt_len": prompt_len, "steps": steps, "step_ms": {str(b): v for b, v in ms.items()},
            "ratio_to_batch_1": {str(b): ms[b] / ms[1] for b in BATCHES[1:]}}


def run(model: str | None, threads: int | None = None) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints); ``model`` None: no decode steps."""
    if threads:
        torch.set_num_threads(threads)
    report: dict[str, Any] = {"cpu": cpu_info(), "kernels": kernel_info(), "self_tests": self_tests(),
                              "machine": machine_peaks()}
    report["all_self_tests_passed"] = all(t["passed"] for t in report["self_tests"])
    if model:
        report["decode"] = decode_steps(model)
    return report


def format_report(r: dict[str, Any]) -> str:
    cpu, k, m = r["cpu"], r["kernels"], r["machine"]
    lines = [f"cpu        {cpu['model']}, {cpu['logical_cpus']} logical CPUs, torch threads {cpu['threads']}",
             f"features   {' '.join(cpu['features'])}",
             f"kernels    {k['why']}",
             f"small 8-bit batches (AVX-512 builds): {k['small_batches']}",
             f"weights in huge pages: {k['weights_in_huge_pages']}"]
    for name, v in k["variants"].items():
        state = "runs here" if v["runnable"] else f"CPU lacks {' '.join(v['lacks'])}"
        lines.append(f"  {name:<12} {state}{'; rounds activations to bfloat16' if v['rounds_activations_to_bf16'] else ''}")
    lines += ["", "| variant | check | contract | max error | bound | result |", "|---|---|---|---|---|---|"]
    lines += [f"| {t['variant']} | {t['name']} | {t['contract']} | {t['max_error']:.3g} | {t['limit']:.3g} | "
              f"{'pass' if t['passed'] else 'FAIL'} |" for t in r["self_tests"]]
    lines += ["", "| machine | value |", "|---|---|",
              f"| read bandwidth (torch sum, 128 MiB) | {m['read_bandwidth_gb_s']:.1f} GB/s |",
              f"| float32 matmul (torch.mm 1024^3) | {m['torch_f32_matmul_gflop_s']:.1f} GFLOP/s |"]
    if "int8_peak_gop_s" in m:
        lines += [f"| int8 peak ({m['int8_instruction']}, all threads) | {m['int8_peak_gop_s']:.1f} GOP/s |",
                  f"| float32 peak ({m['f32_instruction']}, all threads) | {m['f32_peak_gflop_s']:.1f} GFLOP/s |"]
    if "decode" in r:
        d = r["decode"]
        lines += ["", f"decode steps: {d['model']}, {d['prompt_len']}-token prompts, median of {d['steps']} steps",
                  "| batch | step ms | x batch 1 |", "|---|---|---|"]
        lines += [f"| {b} | {ms:.2f} | {ms / d['step_ms']['1']:.2f} |" for b, ms in d["step_ms"].items()]
    lines.append("\nall self-tests passed" if r["all_self_tests_passed"] else "\nSOME SELF-TESTS FAILED")
    return "\n".join(lines)
