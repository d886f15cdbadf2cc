"""The batched 8-bit activation path (``csrc/q8batch.c``: AVX-512 VNNI, each weight block unpacked
once per call and reused by every activation row). Its contract is q8act.c's: exact integer block
sums and one fixed float order, so every variant equals the plain-C reference bit for bit at every
batch (packed Q4 up to 16 rows on the AVX-512 builds: strip_direct's tiles of 8 rows straight from
the packed bytes, 2 and 7 its ragged tiles; Q8_0 up to 8 rows: q8batch.c's zmm direct strips
(the AVX2 builds: q8act.c's direct path up to 3 rows), above: the vpdpbusd panel; 64 and up on the amx build: AMX tiles; Q4_K / Q5_K / Q6_K at 1 row: q8act.c's
panel, above: the vpdpbusd strips; ragged last tiles, a lone last group of 8 weight rows, N % 8
leftover rows), and a row's result does not depend on the rows beside it."""
from __future__ import annotations

import pytest
import torch
from gguf_files import random_blocks
from kernel_variants import VARIANTS, rand, runnable

from treadle.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")

BATCHES = (1, 2, 4, 5, 7, 16, 17, 64, 71)
# (K, N): SmolLM2's hidden size (18 blocks); its MLP width (48 blocks); N = 5 groups (two strips
# and a lone group), N = 24 + 3 (a lone group, then rows that go alone)
SHAPES = ((576, 40), (1536, 24))
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
AMX_AFTER_ONEDNN_TYPES = ["Q4_0", "Q8_0"]


def inputs(qtype: str, k: int) -> int:
    """k, or for a K-quant (super-blocks of 256) 768 in place of 576."""
    return 768 if qtype.endswith("_K") and k % 256 else k


def weights(qtype: str, n: int, k: int, seed: int) -> tuple[tuple[tuple[str, int], ...], torch.Tensor]:
    """Random ``qtype`` rows as the engine holds them: Q4_0 / Q4_1 whole groups of 8 packed (as with
    8-bit activations), the rows past them a segment of their own."""
    w = random_blocks(qtype, n, k, seed=seed).data.reshape(-1).clone()
    whole = n // 8 * 8
    if qtype not in native.PACKED.values():
        return ((qtype, n),), w
    packed = native.pack_rows(qtype, w[: whole * w.numel() // n], whole, k)
    return ((packed, whole), *(((qtype, n - whole),) if n > whole else ())), w


@VARIANTS
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_every_batch_equals_the_plain_reference_bitwise(variant: str, qtype: str, k: int, n: int) -> None:
    runnable(variant)
    k = inputs(qtype, k)
    seg, w = weights(qtype, n, k, seed=101)
    bias = rand(n, seed=102)
    for m in BATCHES:
        x = rand(m, k, seed=103 + m)
        y = native.qmatmul(seg, w, x, bias, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, bias, plain=True, act_bits=8)), f"batch {m}"


@VARIANTS
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(variant: str, qtype: str) -> None:
    runnable(variant)
    k, n = inputs(qtype, 576), 27 * 8 + 5  # 27 groups: 13 strips and a lone group; 5 rows alone
    seg, w = weights(qtype, n, k, seed=111)
    x = rand(64, k, seed=112)
    full = native.qmatmul(seg, w, x, variant=variant, act_bits=8)
    alone = torch.stack([native.qmatmul(seg, w, x[i : i + 1], variant=variant, act_bits=8)[0] for i in range(64)])
    assert torch.equal(full, alone)
    for m in (5, 9, 16, 17, 33):  # batches that end in ragged tiles, other rows beside each row
        assert torch.equal(native.qmatmul(seg, w, x[:m], variant=variant, act_bits=8), full[:m]), f"batch {m}"
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(113))
    assert torch.equal(native.qmatmul(seg, w, x[perm], variant=variant, act_bits=8), full[perm])


@VARIANTS
@pytest.mark.parametrize(("k", "n"), ((576, 40), (1536, 24), (576, 27 * 8 + 5)))
def test_q8_0_every_batch_from_1_to_17_equals_the_plain_reference_bitwise(variant: str, k: int, n: int) -> None:
    """Q8_0 (the lm_head) at every batch 1..17: on the AVX-512 builds 1..8 rows take the direct zmm
    strips (tiles of 1..8 rows), 9..17 the panel (tiles of 8 and a ragged one); on the AVX2 builds
    1..3 the 256-bit direct path, then the panel. Strips, a lone last group and N % 8 rows alone."""
    runnable(variant)
    seg, w = weights("Q8_0", n, k, seed=131)
    bias = rand(n, seed=132)
    for m in range(1, 18):
        x = rand(m, k, seed=133 + m)
        y = native.qmatmul(seg, w, x, bias, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, bias, plain=True, act_bits=8)), f"batch {m}"
        if m in (1, 4, 8, 9):  # each row as it comes out alone
            alone = torch.cat([native.qmatmul(seg, w, x[i : i + 1], bias, variant=variant, act_bits=8) for i in range(m)])
            assert torch.equal(y, alone), f"batch {m}"


@VARIANTS
def test_q8_0_extreme_bytes_stay_exact_at_every_direct_batch(variant: str) -> None:
    """Q8_0 bytes -128 / 127 against activations at +-127 at batches 1..9: the +128 offset
    (bytes + 128 up to 255, minus 128 x the block sum) stays exact in the direct strips' int32 lanes."""
    runnable(variant)
    seg, w = weights("Q8_0", 40, 576, seed=141)
    blocks = w.view(torch.uint8).view(-1, 34)
    blocks[:, 2:18] = 0x80  # -128
    blocks[:, 18:] = 0x7F
    for m in range(1, 10):
        x = torch.ones(m, 576) * torch.where(torch.arange(576) % 3 == 0, -1.0, 1.0)
        x[m // 2] *= -1.0
        y = native.qmatmul(seg, w, x, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, plain=True, act_bits=8)), f"batch {m}"
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("qtype", AMX_AFTER_ONEDNN_TYPES)
def test_amx_tiles_survive_another_amx_user_on_the_thread(qtype: str) -> None:
    """torch's bfloat16 matmul (oneDNN) uses AMX tiles on this thread and releases them. q8amx.c
    loads its tile configuration at each call, so its next call still gives the reference's bits
    (a configuration kept from an earlier call, as q8amx.c once did, died of SIGILL here)."""
    variant = runnable("amx")
    k, n, m = 512, 40, 130
    seg, w = weights(qtype, n, k, seed=171)
    x = rand(m, k, seed=172)
    ref = native.qmatmul(seg, w, x, plain=True, act_bits=8)
    assert torch.equal(native.qmatmul(seg, w, x, variant=variant, act_bits=8), ref)
    a = rand(256, 256, seed=173).to(torch.bfloat16)
    for _ in range(3):
        a @ a  # noqa: B018  (oneDNN's AMX tiles, then released)
    assert torch.equal(native.qmatmul(seg, w, x, variant=variant, act_bits=8), ref)


def test_extreme_activations_and_weights_stay_exact() -> None:
    """Activations at +-127 everywhere and weights at their extremes (nibbles 15, Q8_0 bytes
    -128 / 127; Q4_K nibbles and 6-bit scales and minimums at 15 / 63; Q6_K q - 32 = -32 with
    its int8 scales -128, the largest terms of its int32 fold): the int32 sums (and Q8_0's +128
    offset) are exact, so still the reference's bits."""
    for qtype in ("Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        k = inputs(qtype, 576)
        seg, w = weights(qtype, 32, k, seed=121)
        raw = w.view(torch.uint8)
        if qtype == "Q4_K":
            raw.view(-1, 144)[:, 4:] = 0xFF
        elif qtype == "Q6_K":
            blocks = raw.view(-1, 210)
            blocks[:, :192] = 0  # ql, qh: q = 0, read as 0 - 32
            blocks[:, 192:208] = 0x80  # the 16 int8 scales: -128
        elif qtype == "Q8_0":
            blocks = raw.view(-1, 34)
            blocks[:, 2:18] = 0x80  # -128
            blocks[:, 18:] = 0x7F
        else:
            nib = raw.view(-1, 20 * 8)  # packed: 8 rows' d, m, then 128 nibble bytes per block
            nib[:, 32:] = 0xFF
        x = torch.ones(17, k) * torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
        y = native.qmatmul(seg, w, x, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, plain=True, act_bits=8))
        assert torch.isfinite(y).all()
