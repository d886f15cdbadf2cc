"""Every environment variable Treadle reads, with its default and meaning, in one table.

Code never calls ``os.environ`` for these directly: it calls the typed reader below, which
reads the variable at call time (so a test or a child process may set it first).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("TREADLE_CACHE_DIR", None, "where compiled C kernels are cached (default ~/.cache/treadle)"),
    EnvVar("TREADLE_NATIVE_KERNELS", "1", "0: never compile or use Treadle's C kernels (torch fallbacks)"),
    EnvVar("TREADLE_CPU_KERNELS", None, "the C kernels' variant to run instead of the best one this CPU runs: a "
                                       "name from kernels/native.py VARIANTS (plain, avx2, avx-vnni, avx512-vnni, "
                                       "avx512-bf16, amx); refused when the CPU lacks its features; unset or auto: "
                                       "the best"),
    EnvVar("TREADLE_ACTIVATION_BITS", "16", "8 or 16: how the C kernels round activations for GGUF Q4_0/Q4_1/Q5_0/"
                                           "Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights (int8 or int16 per block of 32); with 8, "
                                           "a load repacks Q4_0/Q4_1/Q8_0/Q4_K/Q6_K rows 8 at a time"),
    EnvVar("TREADLE_SMALL_BATCH_PATH", "auto", "with 8-bit activations, which code takes batches of up to 4 rows "
                                              "(3 for Q8_0 as the file has it, 2 for Q6_K) in the AVX-512 builds: 256 "
                                              "(q8act.c's 256-bit register paths) or 512 (q8batch.c's zmm strips); auto: "
                                              "256 on AMD Zen 4, 512 elsewhere; the same bits either way"),
    EnvVar("TREADLE_HUGE_PAGES", "1", "0: a loaded CPU model's weights stay where torch allocated them, not "
                                      "gathered into one mapping advised for transparent huge pages "
                                      "(loaders/huge_pages.py)"),
    EnvVar("CC", None, "the C compiler for Treadle's kernels (default: gcc, else cc)"),
    EnvVar("TREADLE_FUSED_OPS", "1", "0: RMSNorm+residual and RoPE run as separate torch ops, not fused"),
    EnvVar("TREADLE_API_KEY", None, "default for `treadle serve --api-key`"),
    EnvVar("TREADLE_EXECUTE_TIMEOUT_S", "300", "mp executor: seconds a step may take before the engine "
                                               "declares its workers hung and dead"),
    EnvVar("TREADLE_PP_BATCH_QUEUE", "1", "0: under pipeline parallelism keep one step in flight, not one per "
                                          "stage (for comparisons)"),
    EnvVar("TREADLE_WORKER_START_TIMEOUT_S", "600", "mp executor: seconds workers may take to load the model"),
    EnvVar("TREADLE_WORKER_STOP_GRACE_S", "5", "mp executor: seconds stopping workers may take at shutdown before "
                                           "they are killed"),
    EnvVar("TREADLE_LLAMACPP_BIN", None, "benchmarks: the folder of the llama.cpp peer's binaries (default: "
                                        "what tools/build_llamacpp.sh built for this CPU, in the cache)"),
    EnvVar("TREADLE_LLAMACPP_ARGS", None, "benchmarks: more arguments for the llama-server peer, e.g. "
                                         "--no-repack (keeps ggml off its AMX matmul where that faults)"),
    EnvVar("TRITON_INTERPRET", None, "1: Triton kernels run in the interpreter (the triton backend on a CPU, "
                                     "for tests)"),
)
_BY_NAME = {v.name: v for v in VARIABLES}
_FALSE = ("0", "false", "no", "off")


def get(name: str) -> str | None:
    """The variable's value, or its default when unset."""
    return os.environ.get(name, _BY_NAME[name].default)


def get_flag(name: str) -> bool:
    value = get(name)
    return value is not None and value.strip().lower() not in (*_FALSE, "")


def get_seconds(name: str) -> float:
    value = get(name)
    try:
        seconds = float(value) if value is not None else 0.0
    except ValueError:
        from treadle.config import TreadleError

        raise TreadleError(f"{name}={value!r} is not a number of seconds") from None
    return seconds


def cache_dir() -> str:
    return get("TREADLE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "treadle")


def native_kernels() -> bool:
    return get_flag("TREADLE_NATIVE_KERNELS")


def cpu_kernels() -> str | None:
    """The forced kernel variant's name (checked by kernels/native.py), or None for the automatic choice."""
    value = (get("TREADLE_CPU_KERNELS") or "").strip().lower()
    return None if value in ("", "auto") else value


def activation_bits() -> int:
    value = get("TREADLE_ACTIVATION_BITS")
    if value not in ("8", "16"):
        from treadle.config import TreadleError

        raise TreadleError(f"TREADLE_ACTIVATION_BITS={value!r}: the GGUF kernels' activations take 8 or 16 bits")
    return int(value)


def small_batch_path() -> str | None:
    """256 / 512 for TREADLE_SMALL_BATCH_PATH, or None for the automatic choice (kernels/native.py)."""
    value = (get("TREADLE_SMALL_BATCH_PATH") or "auto").strip().lower()
    if value not in ("auto", "256", "512"):
        from treadle.config import TreadleError

        raise TreadleError(f"TREADLE_SMALL_BATCH_PATH={value!r}: auto, 256 or 512")
    return None if value == "auto" else value


def huge_pages() -> bool:
    return get_flag("TREADLE_HUGE_PAGES")


def fused_ops() -> bool:
    return get_flag("TREADLE_FUSED_OPS")


def api_key() -> str | None:
    return get("TREADLE_API_KEY")


def triton_interpret() -> bool:
    return get("TRITON_INTERPRET") == "1"


def execute_timeout_s() -> float:
    return get_seconds("TREADLE_EXECUTE_TIMEOUT_S")


def worker_start_timeout_s() -> float:
    return get_seconds("TREADLE_WORKER_START_TIMEOUT_S")


def worker_stop_grace_s() -> float:
    return get_seconds("TREADLE_WORKER_STOP_GRACE_S")
