"""Each kernel variant checked against the plain-C reference build on random inputs, by the
accuracy contract the variant promises (what ``treadle doctor`` prints, and what the tests in
tests/kernels/test_kernel_variants.py, test_q8_activations.py and test_bf16_matmul.py hold every variant to):

    check                    contract
    w8a8 int8 x int8         bit-exact (exact int32 sums, the same float scaling)
    Q8_0 / Q4_1 / Q4_K /     bit-exact (exact int32 sums per block, the same float order), packed
    Q6_K, 8-bit acts         Q4_1 rows at 64 activation rows too (the batched int8 path), packed
                             Q8_0 rows at 16 (a batch's lm_head), packed Q4_K / Q6_K rows at 1
                             (q8act.c's registers)
    Q4_1 / Q6_K, 16-bit acts float32 sums of exact block products in another order: |err| <= 1e-5 max|y|
    bfloat16 weights         bit-exact (the same FMAs in the same order), except a variant that rounds
                             activations to bfloat16 (``native.rounds_activations_to_bf16``):
                             the reference on the rounded activations to 1e-5 max|y|

A check's error is max |variant - reference| over the output, and ``limit`` the contract's bound
(0 for bit-exact)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.kernels import native

SUM_ORDER = 1e-5  # float32 sums of the same exact products in another order, relative to max |y|
M, N, K = 5, 36, 512  # activation rows, weight rows (not a multiple of a tile), inputs (two K-quant blocks)


@dataclass(frozen=True)
class Check:
    variant: str
    name: str
    contract: str
    max_error: float
    limit: float

    @property
    def passed(self) -> bool:
        return self.max_error <= self.limit


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _blocks(qtype: str, seed: int, n: int = N) -> torch.Tensor:
    """[N, K] random weights as ``qtype`` blocks, flat uint8: the gguf package's quantizer for the
    legacy types; for a K-quant, random bytes with small finite float16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    if not qtype.endswith("_K"):
        w = _rand(n, K, seed=seed) * 0.1
        return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype])).reshape(-1)
    inputs, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * K // inputs, nbytes), dtype=np.uint8)
    for at in _HALVES[qtype]:  # the super-block's float16 d (and dmin)
        raw[:, at : at + 2] = (rng.uniform(0.5, 1.0, size=(raw.shape[0], 1)) * 1e-4).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw).reshape(-1)


_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # qblocks.h layouts


def _check(variant: str, name: str, got: torch.Tensor, ref: torch.Tensor, exact: bool) -> Check:
    err = float((got - ref).abs().max())
    limit = 0.0 if exact else SUM_ORDER * float(ref.abs().max())
    return Check(variant, name, "bit-exact" if exact else f"<= {SUM_ORDER:g} max|y|", err, limit)


def _w8a8(variant: str) -> Check:
    gen = torch.Generator().manual_seed(1)
    x = _rand(M, K, seed=2) * 3
    w = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(N, generator=gen) * 0.01, _rand(N, seed=3)
    got = native.w8a8_matmul(x, w, scale, bias, variant=variant)
    return _check(variant, "w8a8 int8 x int8", got, native.w8a8_matmul(x, w, scale, bias, plain=True), True)


def _blocks_check(variant: str, qtype: str, act_bits: int) -> Check:
    w, x = _blocks(qtype, seed=4), _rand(M, K, seed=5)
    seg = ((qtype, N),)
    got = native.qmatmul(seg, w, x, variant=variant, act_bits=act_bits)
    ref = native.qmatmul(seg, w, x, plain=True, act_bits=act_bits)
    return _check(variant, f"{qtype}, {act_bits}-bit activations", got, ref, act_bits == 8)


def _packed(variant: str, qtype: str, rows: int, bits: int = 8) -> Check:
    """``qtype`` rows packed 8 at a time (the layout is the same in every build): at 64 activation
    rows the batched 8-bit path where the build has one (csrc/q8batch.c; q8amx.c from 32 rows), at
    1 row q8act.c's registers; at 16 bits the legacy types' split activations (csrc/q8pack.c
    tq_q16_split), the plain-C reference's bits too."""
    n = 32
    w, x = _blocks(qtype, seed=9, n=n).clone(), _rand(rows, K, seed=10)
    seg = ((native.pack_rows(qtype, w, n, K), n),)
    got = native.qmatmul(seg, w, x, variant=variant, act_bits=bits)
    return _check(variant, f"{qtype} packed x8, {bits}-bit activations, {rows} row{'s' * (rows > 1)}", got,
                  native.qmatmul(seg, w, x, plain=True, act_bits=bits), True)


def _bf16(variant: str) -> Check:
    x, w, b = _rand(M, K, seed=6), _rand(N, K, seed=7).bfloat16(), _rand(N, seed=8)
    got = native.bf16_matmul(x, w, b, variant=variant)
    if native.rounds_activations_to_bf16(variant):
        ref = native.bf16_matmul(x.bfloat16().float(), w, b, plain=True)
        check = _check(variant, "bfloat16 weights (activations rounded to bfloat16)", got, ref, False)
        return check
    return _check(variant, "bfloat16 weights", got, native.bf16_matmul(x, w, b, plain=True), True)


def run(variant: str) -> list[Check]:
    """Every check of ``variant`` (one this CPU runs) against the plain-C build."""
    return [_w8a8(variant), _blocks_check(variant, "Q8_0", 8), _blocks_check(variant, "Q4_1", 8),
            _blocks_check(variant, "Q4_K", 8), _blocks_check(variant, "Q6_K", 8), _packed(variant, "Q4_1", 64),
            _packed(variant, "Q8_0", 16), _packed(variant, "Q4_K", 1), _packed(variant, "Q6_K", 1),
            _packed(variant, "Q5_0", 1), _packed(variant, "Q5_1", 64), _packed(variant, "Q8_0", 1, 16),
            _packed(variant, "Q4_1", 16, 16),
            _blocks_check(variant, "Q4_1", 16), _blocks_check(variant, "Q6_K", 16), _bf16(variant)]


def runnable_variants() -> list[str]:
    return [v.name for v in native.VARIANTS if not native.missing_features(v.name)]
