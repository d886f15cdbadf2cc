"""Packed Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K rows at 16-bit activations (``csrc/q8pack.c`` tq_q16_split):
the 16-bit values of qmatmul.c's rounding, each split in two bytes, v = 256 hi + lo, so the 8-bit
kernels' vpdpbusd forms the exact block dot of the 16-bit values (the zmm builds' registers and
strips; the other builds' plain C). The contract, in every runnable build and by either
small-batch path: the plain-C reference's bits at every batch, a row's result independent of its
batch, and the dequantized weights times the 16-bit-rounded activations up to float32 summation
(the file layout's 16-bit path is held to the same, in its own float order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks
from kernel_variants import VARIANTS, rand, runnable

from treadle.kernels import native
from treadle.layers.linear import Linear
from treadle.quantization.methods.gguf_native import GGUFBlockMethod, dequantize_blocks

pytestmark = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")
K = 576  # 18 blocks
K_SUPER = 768  # Q4_K: 3 super-blocks
N = 40  # 5 groups: two strips and a lone group
TYPES = list(native.SPLIT_16)


def inputs(qtype: str) -> int:
    return K_SUPER if qtype.endswith("_K") else K
# 1-4: the zmm builds' 256-bit registers (TREADLE_SMALL_BATCH_PATH=256) or strips of 4-row chains;
# 5-8 one tile of the strips, 9 and 17 a ragged last tile, 33 beyond the 8-bit path's panel threshold
BATCHES = (1, 2, 3, 4, 5, 8, 9, 17, 33)


def q16(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round 16-bit activations: per block of 32, max |x| / 32767."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 32767
    return (torch.round(b * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))) * d).reshape(x.shape)


def packed(qtype: str, seed: int) -> tuple[tuple[tuple[str, int], ...], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed segment, packed rows, the file's rows, dequantized weight)."""
    k = inputs(qtype)
    blocks = random_blocks(qtype, N, k, seed=seed)
    w = blocks.data.reshape(-1)
    p = w.clone()
    return ((native.pack_rows(qtype, p, N, k), N),), p, w, dequantize_blocks(blocks)


@VARIANTS
@pytest.mark.parametrize("path", ["256", "512"])
@pytest.mark.parametrize("qtype", TYPES)
def test_packed_rows_at_16_bits_give_the_plain_references_bits(variant: str, path: str, qtype: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    runnable(variant)
    monkeypatch.setenv("TREADLE_SMALL_BATCH_PATH", path)
    seg, p, w, w_deq = packed(qtype, seed=11)
    bias = rand(N, seed=12)
    for rows in BATCHES:
        x = rand(rows, inputs(qtype), seed=13 + rows)
        y = native.qmatmul(seg, p, x, bias, variant=variant, act_bits=16)
        assert torch.equal(y, native.qmatmul(seg, p, x, bias, plain=True, act_bits=16)), f"batch {rows}"
        oracle = F.linear(q16(x), w_deq, bias)
        tol = float(oracle.abs().max()) * 1e-5
        torch.testing.assert_close(y, oracle, rtol=0, atol=tol)
        file_rows = native.qmatmul(((qtype, N),), w, x, bias, variant=variant, act_bits=16)
        torch.testing.assert_close(y, file_rows, rtol=0, atol=tol)


@VARIANTS
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_result_does_not_depend_on_its_batch(variant: str, qtype: str) -> None:
    runnable(variant)
    seg, p, _, _ = packed(qtype, seed=21)
    x = rand(17, inputs(qtype), seed=22)
    batch = native.qmatmul(seg, p, x, variant=variant, act_bits=16)
    for i in range(17):
        assert torch.equal(native.qmatmul(seg, p, x[i : i + 1], variant=variant, act_bits=16)[0], batch[i])
    for m in (3, 6, 12):
        assert torch.equal(native.qmatmul(seg, p, x[:m], variant=variant, act_bits=16), batch[:m])


@VARIANTS
@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_1", "Q4_K"])
def test_extreme_values_stay_exact(variant: str, qtype: str) -> None:
    """Each block's largest magnitude negative (its 16-bit value -32767: high byte -128, which a
    sign flip cannot negate) and Q8_0 bytes -128 / 127: the split sums stay the exact integers."""
    runnable(variant)
    seg, p, _, w_deq = packed(qtype, seed=31)
    if qtype == "Q8_0":
        raw = p.view(-1, 34 * 8)  # a packed group's block: 8 d, then 8 steps of 32 bytes
        raw[:, 16:144] = 0x80
        raw[:, 144:] = 0x7F
        w_deq = native.dequantize(seg[0][0], p, N, K)
    k = inputs(qtype)
    for rows in (1, 4, 9):
        x = torch.ones(rows, k) * torch.where(torch.arange(k) % 3 == 0, -1.0, 0.5)
        x[:, ::32] = -2.0  # every block's largest magnitude, negative
        y = native.qmatmul(seg, p, x, variant=variant, act_bits=16)
        assert torch.equal(y, native.qmatmul(seg, p, x, plain=True, act_bits=16)), f"batch {rows}"
        oracle = F.linear(q16(x), w_deq)
        torch.testing.assert_close(y, oracle, rtol=0, atol=float(oracle.abs().max()) * 1e-5)


def test_loading_at_16_bits_packs_the_legacy_rows_where_the_build_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 16 bits the loader packs the Q4_1 and Q4_K segments (whole groups) in the zmm builds
    (``native.packs_at_16_bits``), never Q6_K ones, nor the 5 Q8_0 rows (no whole group); the
    layer's output stays within the 16-bit contract of the file's rows, and a second call changes
    nothing."""
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "16")
    k = 512
    shards = [random_blocks(t, n, k, seed=40 + n) for t, n in (("Q4_1", 16), ("Q4_K", 8), ("Q6_K", 24), ("Q8_0", 5))]
    layer = Linear(k, [16, 8, 24, 5], False, torch.float32, GGUFBlockMethod([b.qtype for b in shards]))
    for i, b in enumerate(shards):
        layer.weight.weight_loader(layer.weight, b, i)  # type: ignore[attr-defined]
    x = rand(3, k, seed=45)
    before = layer(x)
    split = native.packs_at_16_bits()
    for _ in range(2):
        layer.method.process_weights_after_loading(layer)
        legacy = "x8" if split else ""
        assert layer.method.segments == (("Q4_1" + legacy, 16), ("Q4_K" + legacy, 8), ("Q6_K", 24), ("Q8_0", 5))
        after = layer(x)
        torch.testing.assert_close(after, before, rtol=0, atol=float(before.abs().max()) * 1e-5)
        assert torch.equal(after[:, 24:], before[:, 24:])  # the rows left as the file has them: the same bits


def test_only_the_zmm_builds_pack_at_16_bits() -> None:
    for v in native.VARIANTS:
        flags = set(v.flags)
        assert native.packs_at_16_bits(v.name) == ({"-mavx512bw", "-mavx512vnni"} <= flags)
    assert not native.packs_at_16_bits("plain") and not native.packs_at_16_bits("avx2")
