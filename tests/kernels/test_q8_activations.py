"""The 8-bit activation path of the GGUF matmul (``csrc/q8act.c``, a layout's ``act_bits`` 8):
every runnable SIMD variant equals the plain-C reference bit for bit (exact integer sums, one
fixed float order), equals the dequantized weights times the int8-rounded activations up to
float32 summation, and a row's result does not depend on its batch; for the legacy types and
Q4_K, Q5_K, Q6_K. Q2_K / Q3_K segments of the same weight keep 16-bit activations. Q4_0 / Q4_1 /
Q4_K / Q6_K rows packed 8 at a time at load give the same bits as the file's layout."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks
from kernel_variants import VARIANTS, rand, runnable

from treadle.config import TreadleError
from treadle.kernels import native
from treadle.layers.linear import Linear
from treadle.quantization.methods.gguf_native import GGUFBlockMethod, dequantize_blocks

K = 576  # 18 blocks: the minimum terms' 8-lane sums have a padded tail (SmolLM2's hidden size)
K_SUPER = 768  # the K-quants: 3 super-blocks of 256
N = 45  # 5 groups of 8 (two tiled as a pair, one alone) and 5 rows that go alone
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def inputs(qtype: str) -> int:
    return K_SUPER if qtype.endswith("_K") else K
pytestmark = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")


def q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the 8-bit path rounds activations: int8 per block of 32."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))) * d).reshape(x.shape)


@VARIANTS
@pytest.mark.parametrize("qtype", TYPES)
def test_variant_equals_reference_bitwise_and_the_oracle(variant: str, qtype: str) -> None:
    runnable(variant)
    k = inputs(qtype)
    blocks = random_blocks(qtype, N, k, seed=21)
    w, seg = blocks.data.reshape(-1), ((qtype, N),)
    bias = rand(N, seed=22)
    # 1-3: Q8_0 straight from the rows; 5, 16: the panel; AVX-512 K-quants: strips from 2; 48, 130: the
    # amx build's AMX tiles (Q4_K / Q5_K from AMX_MIN_K rows, Q6_K from AMX_MIN_Q6K, packed Q4 / Q8_0 from AMX_MIN_PACKED)
    for rows in (1, 2, 3, 5, 16, 21, 48, 130):
        x = rand(rows, k, seed=23 + rows)
        y = native.qmatmul(seg, w, x, bias, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, bias, plain=True, act_bits=8))
        oracle = F.linear(q8(x), dequantize_blocks(blocks), bias)
        torch.testing.assert_close(y, oracle, rtol=0, atol=float(oracle.abs().max()) * 1e-5)


@VARIANTS
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_bitwise_equal_whatever_the_batch(variant: str, qtype: str) -> None:
    runnable(variant)
    k = inputs(qtype)
    blocks = random_blocks(qtype, N, k, seed=31)
    w, seg = blocks.data.reshape(-1), ((qtype, N),)
    x = rand(16, k, seed=32)
    batch = native.qmatmul(seg, w, x, variant=variant, act_bits=8)
    for i in range(16):
        assert torch.equal(native.qmatmul(seg, w, x[i : i + 1], variant=variant, act_bits=8)[0], batch[i])
    for m in (3, 6):  # tiles of 4 rows with a ragged last one
        assert torch.equal(native.qmatmul(seg, w, x[:m], variant=variant, act_bits=8), batch[:m])
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(33))
    assert torch.equal(native.qmatmul(seg, w, x[perm], variant=variant, act_bits=8), batch[perm])


@pytest.mark.parametrize("rows", [3, 16])
def test_mixed_layout_takes_each_segments_path(rows: int) -> None:
    """A fused weight of Q4_1, Q4_K, Q6_K and Q3_K rows (a Q4_K_M-style q/k/v mix): each of the
    first three segments equals its own 8-bit matmul, the Q3_K rows the 16-bit path's."""
    k = 512
    segs = (("Q4_1", 6), ("Q4_K", 16), ("Q6_K", 13), ("Q3_K", 5))
    parts = [random_blocks(t, n, k, seed=41 + i) for i, (t, n) in enumerate(segs)]
    w = torch.cat([p.data.reshape(-1) for p in parts])
    x = rand(rows, k, seed=43)
    y = native.qmatmul(segs, w, x, act_bits=8)
    n0 = 0
    for (t, n), p in zip(segs, parts):
        bits = 16 if t == "Q3_K" else 8
        assert torch.equal(y[:, n0 : n0 + n], native.qmatmul(((t, n),), p.data.reshape(-1), x, act_bits=bits))
        n0 += n
    assert not torch.equal(y[:, 6:22], native.qmatmul((("Q4_K", 16),), parts[1].data.reshape(-1), x, act_bits=16))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_the_two_paths_differ_only_by_the_activations_rounding(qtype: str) -> None:
    k = inputs(qtype)
    blocks = random_blocks(qtype, N, k, seed=51)
    x = rand(4, k, seed=52)
    y8 = native.qmatmul(((qtype, N),), blocks.data.reshape(-1), x, act_bits=8)
    y16 = native.qmatmul(((qtype, N),), blocks.data.reshape(-1), x, act_bits=16)
    exact = F.linear(x, dequantize_blocks(blocks))
    assert not torch.equal(y8, y16)
    assert float((y8 - exact).abs().max()) > float((y16 - exact).abs().max())
    torch.testing.assert_close(y8, exact, rtol=0, atol=float(exact.abs().max()) * 0.03)


def test_bad_activation_bits_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="8 or 16"):
        native.layout((("Q4_1", 4),), act_bits=4)
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "12")
    with pytest.raises(TreadleError, match="TREADLE_ACTIVATION_BITS"):
        native.layout((("Q4_1", 4),))


@VARIANTS
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_rows_give_the_file_layouts_bits(variant: str, qtype: str) -> None:
    """``native.pack_rows`` (8 rows at a time, in place): the same bits as the file's layout
    for batches on both packed paths (registers up to 4 rows, the panel beyond), in every build;
    packed Q6_K rows take 8-bit activations whatever is asked (the others take 16-bit ones split in
    two bytes: test_split16_activations.py); lookups read the file's values back."""
    runnable(variant)
    n, K = 40, inputs(qtype)
    blocks = random_blocks(qtype, n, K, seed=61)
    w = blocks.data.reshape(-1)
    packed = w.clone()
    name = native.pack_rows(qtype, packed, n, K)
    assert name == qtype + "x8" and not torch.equal(packed, w)
    bias = rand(n, seed=62)
    for rows in (1, 3, 4, 5, 16):
        x = rand(rows, K, seed=63 + rows)
        ref = native.qmatmul(((qtype, n),), w, x, bias, plain=True, act_bits=8)
        assert torch.equal(native.qmatmul(((name, n),), packed, x, bias, variant=variant, act_bits=8), ref)
        if qtype not in native.SPLIT_16:
            assert torch.equal(native.qmatmul(((name, n),), packed, x, bias, plain=True, act_bits=16), ref)
    ids = torch.tensor([0, 7, 8, 39, 21])
    assert torch.equal(native.gather_rows(name, packed, ids, K), native.gather_rows(qtype, w, ids, K))
    assert torch.equal(native.dequantize(name, packed, n, K, plain=True), native.dequantize(qtype, w, n, K))


def test_loading_with_8_bit_activations_packs_whole_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards Q4_1 (16 rows), Q8_0 (8), Q4_0 (5): the Q4_1 and Q8_0 segments are packed (5 rows
    are no whole group); the layer's output is unchanged, and a second call changes nothing."""
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "8")
    shards = [random_blocks(t, n, K, seed=70 + n) for t, n in (("Q4_1", 16), ("Q8_0", 8), ("Q4_0", 5))]
    layer = Linear(K, [16, 8, 5], False, torch.float32, GGUFBlockMethod([b.qtype for b in shards]))
    for i, b in enumerate(shards):
        layer.weight.weight_loader(layer.weight, b, i)  # type: ignore[attr-defined]
    x = rand(3, K, seed=75)
    before = layer(x)
    for _ in range(2):
        layer.method.process_weights_after_loading(layer)
        assert layer.method.segments == (("Q4_1x8", 16), ("Q8_0x8", 8), ("Q4_0", 5))
        assert torch.equal(layer(x), before)
