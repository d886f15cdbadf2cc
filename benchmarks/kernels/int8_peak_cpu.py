"""How close the 8-bit activation matmul (csrc/q8act.c) runs to this CPU's integer-dot ceiling.

    .venv/bin/python benchmarks/kernels/int8_peak_cpu.py [--batch 256]

On AVX2 without VNNI, a 32-byte dot step is one ``vpmaddubsw`` (32 multiply-adds into int16 pairs),
and every 8 steps of a Q4 block take one ``vpmaddwd`` to widen to int32 (Q8_0: one per step, its
pairs can reach 2 * 128 * 127). This compiles a few-line C loop per instruction (8 independent
chains, thread CPU time), measures how many of each one thread retires per second, and whether
the two multiplies share a port (a loop of both at once). The ceiling of a Q4 matmul is then
32 multiply-adds per maddubs slot with 1 / 9 of the slots taken by widening (8 / 9 of the port),
Q8_0's half that, and the script times the real kernel (one thread, packed Q4_1 rows and the Q8_0
lm_head at SmolLM2's shapes) against it. Both measured in one process, one after the other, so
the fraction is this machine's whatever its clock is doing; the figures name the CPU's flags.
"""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import harness
import torch
from harness import Case

from treadle.kernels import native

LOOPS = r"""
#include <immintrin.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define KEEP __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7))
#define LOOP(NAME, T, INIT, OP)                                                                      \
    double NAME(long n) {                                                                            \
        T a0 = INIT, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, b = INIT;       \
        double t = now();                                                                            \
        for (long k = 0; k < n; k++) {                                                               \
            a0 = OP(a0, b); a1 = OP(a1, b); a2 = OP(a2, b); a3 = OP(a3, b);                          \
            a4 = OP(a4, b); a5 = OP(a5, b); a6 = OP(a6, b); a7 = OP(a7, b);                          \
            KEEP;                                                                                    \
        }                                                                                            \
        return 8.0 * n / (now() - t);                                                                \
    }
#define FMA(x, y) _mm256_fmadd_ps(x, y, y)
LOOP(maddubs, __m256i, _mm256_set1_epi8(1), _mm256_maddubs_epi16)
LOOP(maddwd, __m256i, _mm256_set1_epi8(1), _mm256_madd_epi16)
LOOP(add16, __m256i, _mm256_set1_epi8(1), _mm256_add_epi16)
LOOP(fma_ps, __m256, _mm256_set1_ps(1.0f), FMA)
double mixed(long n) { /* 4 maddubs and 4 maddwd chains: one port if the rate is maddubs' alone */
    __m256i a0 = _mm256_set1_epi8(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, b = a0;
    double t = now();
    for (long k = 0; k < n; k++) {
        a0 = _mm256_maddubs_epi16(a0, b); a1 = _mm256_maddubs_epi16(a1, b);
        a2 = _mm256_maddubs_epi16(a2, b); a3 = _mm256_maddubs_epi16(a3, b);
        a4 = _mm256_madd_epi16(a4, b); a5 = _mm256_madd_epi16(a5, b);
        a6 = _mm256_madd_epi16(a6, b); a7 = _mm256_madd_epi16(a7, b);
        KEEP;
    }
    return 8.0 * n / (now() - t);
}
"""


def loops(tmp: Path) -> ctypes.CDLL:
    src, lib = tmp / "peak.c", tmp / "peak.so"
    src.write_text(LOOPS)
    subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    for name in ("maddubs", "maddwd", "add16", "fma_ps", "mixed"):
        getattr(so, name).restype = ctypes.c_double
        getattr(so, name).argtypes = [ctypes.c_long]
    return so


MATMULS = (("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576))


def matmul(qtype: str, n: int, k: int, m: int) -> Callable[[], object]:
    """One thread's 8-bit matmul of ``m`` rows, packed rows where the type packs."""
    w = harness.random_blocks(qtype, n, k, seed=1).clone()
    seg = native.pack_rows(qtype, w, n, k) if qtype in native.PACKED.values() else qtype
    x = torch.randn(m, k)
    return lambda: native.qmatmul(((seg, n),), w, x, act_bits=8)


def main() -> None:
    ap = harness.parser(__doc__, repeats=7, threads=1)
    ap.add_argument("--batch", type=int, default=256, help="activation rows of the timed matmuls")
    args = ap.parse_args()
    args.threads = 1  # the instruction loops run on one thread: so does the matmul they bound
    run = harness.start(args)
    with tempfile.TemporaryDirectory() as tmp:
        so = loops(Path(tmp))
        n = 50_000_000
        rate = {name: max(getattr(so, name)(n) for _ in range(3))
                for name in ("maddubs", "maddwd", "add16", "fma_ps", "mixed")}
    run.table(["instruction (8 chains)", "G per s"], [[name, r / 1e9] for name, r in rate.items()], digits=2)
    shared = rate["mixed"] < 1.5 * min(rate["maddubs"], rate["maddwd"])
    print(f"vpmaddubsw and vpmaddwd {'share' if shared else 'do not share'} a port "
          f"(both at once: {rate['mixed'] / 1e9:.2f} G/s)")
    slot = rate["maddubs"]
    ceilings = {"Q4_1": 32 * slot * (8 / 9 if shared else 1), "Q8_0": 32 * slot / (2 if shared else 1)}
    t = run.time([Case(f"{qtype} {n_}x{k}", matmul(qtype, n_, k, args.batch)) for qtype, n_, k in MATMULS])
    rows = []
    for qtype, n_, k in MATMULS:
        got = n_ * k * args.batch / t.best(f"{qtype} {n_}x{k}")  # multiply-adds per second, best of repeats
        rows.append([f"{qtype} {n_}x{k}", f"{got / 1e9:.1f}", f"{ceilings[qtype] / 1e9:.1f}", f"{got / ceilings[qtype]:.0%}"])
    run.table([f"matmul (M={args.batch})", "GMAC/s", "ceiling GMAC/s", "fraction"], rows)
    run.finish()


if __name__ == "__main__":
    main()
