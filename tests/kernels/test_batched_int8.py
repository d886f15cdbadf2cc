"""The batched 8-bit activation path (``csrc/q8batch.c``: AVX-512 VNNI, each weight block unpacked
once per call and reused by every activation row). Its contract is q8act.c's: exact integer block
sums and one fixed float order, so every variant equals the plain-C reference bit for bit at every
batch (packed Q4 up to 16 rows on the AVX-512 builds: strip_direct's tiles of 8 rows straight from
the packed bytes, 2 and 7 its ragged tiles; Q8_0 as a load packs it: q8batch.c's zmm direct strips at
every batch (the AVX2 builds: q8act.c's direct path up to 4 rows, then the panel); Q8_0 as the file
has it (a segment of rows that is no whole group): up to 8 rows the zmm direct strips (the AVX2
builds: up to 3 rows), above: the vpdpbusd panel; 64 and up on the amx build: AMX tiles; Q4_K / Q6_K
packed as a load packs them, at 1 row q8act.c's registers (the AVX2 builds: 1-4 rows; Q5_K: the panel), above: the vpdpbusd strips, and on the amx build from its thresholds AMX tiles (q8amx.c:
Q4_K / Q5_K int8, Q6_K bfloat16); ragged last tiles, a lone last group of 8 weight rows, N % 8
leftover rows), and a row's result does not depend on the rows beside it."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from gguf_files import random_blocks
from kernel_variants import VARIANTS, rand, runnable

from treadle.config import TreadleError
from treadle.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")

BATCHES = (1, 2, 4, 5, 7, 16, 17, 64, 71)
# (K, N): SmolLM2's hidden size (18 blocks); its MLP width (48 blocks); N = 5 groups (two strips
# and a lone group), N = 24 + 3 (a lone group, then rows that go alone)
SHAPES = ((576, 40), (1536, 24))
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
AMX_AFTER_ONEDNN_TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]


def inputs(qtype: str, k: int) -> int:
    """k, or for a K-quant (super-blocks of 256) 768 in place of 576."""
    return 768 if qtype.endswith("_K") and k % 256 else k


def weights(qtype: str, n: int, k: int, seed: int, edit: Callable[[torch.Tensor], None] | None = None,
            pack: bool = True) -> tuple[tuple[tuple[str, int], ...], torch.Tensor]:
    """Random ``qtype`` rows as the engine holds them: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K whole groups
    of 8 packed (as with 8-bit activations; ``pack=False``: as the file has them), the rows past
    them a segment of their own; ``edit`` changes the file layout's bytes before they are packed."""
    w = random_blocks(qtype, n, k, seed=seed).data.reshape(-1).clone()
    if edit is not None:
        edit(w)
    whole = n // 8 * 8
    if qtype not in native.PACKED.values() or not pack:
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
@pytest.mark.parametrize("path", ["256", "512"])
@pytest.mark.parametrize("qtype", TYPES)
def test_small_batches_give_the_same_bits_by_either_path(variant: str, qtype: str, path: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 1-5 rows with ``TREADLE_SMALL_BATCH_PATH`` 256 (q8act.c's 256-bit register paths,
    the automatic choice on AMD Zen 4) and 512 (the AVX-512 builds' zmm strips, elsewhere): the
    plain-C reference's bits either way, and so the same bits as each other."""
    runnable(variant)
    monkeypatch.setenv("TREADLE_SMALL_BATCH_PATH", path)
    assert native.layout((("Q4_1", 8),), 8).small_256 == (path == "256")
    k = inputs(qtype, 576)
    seg, w = weights(qtype, 40, k, seed=121)
    for m in range(1, 6):
        x = rand(m, k, seed=122 + m)
        y = native.qmatmul(seg, w, x, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, plain=True, act_bits=8)), f"batch {m}"


def test_the_small_batch_path_follows_the_cpu_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: 256-bit paths on AMD family 25 with AVX-512 (Zen 4) only; the variable overrides it;
    a bad value is one clear error."""
    zen4 = ("AuthenticAMD", 25)
    assert native.prefers_256_bit_small_batches(zen4, frozenset({"avx2", "avx512f"}))
    assert not native.prefers_256_bit_small_batches(zen4, frozenset({"avx2"}))  # Zen 3: no AVX-512
    assert not native.prefers_256_bit_small_batches(("AuthenticAMD", 26), frozenset({"avx512f"}))  # Zen 5
    assert not native.prefers_256_bit_small_batches(("GenuineIntel", 6), frozenset({"avx512f"}))
    monkeypatch.setenv("TREADLE_SMALL_BATCH_PATH", "auto")
    assert native.layout((("Q4_1", 8),), 8).small_256 == native.prefers_256_bit_small_batches()
    monkeypatch.setenv("TREADLE_SMALL_BATCH_PATH", "128")
    with pytest.raises(TreadleError, match="TREADLE_SMALL_BATCH_PATH"):
        native.layout((("Q4_1", 8),), 8)


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
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "file-rows"])
@pytest.mark.parametrize(("k", "n"), ((576, 40), (1536, 24), (576, 27 * 8 + 5)))
def test_q8_0_every_batch_from_1_to_17_equals_the_plain_reference_bitwise(variant: str, k: int, n: int,
                                                                         pack: bool) -> None:
    """Q8_0 (the lm_head) at every batch 1..17. Packed (as a load packs it): on the AVX-512 builds
    the direct zmm strips at every batch (tiles of 1..8 rows), on the AVX2 builds 1..4 rows the
    256-bit direct path, then the panel. As the file has it: on the AVX-512 builds 1..8 rows take the
    direct zmm strips, 9..17 the panel (tiles of 8 and a ragged one); on the AVX2 builds 1..3 the
    256-bit direct path, then the panel. Strips, a lone last group and N % 8 rows alone."""
    runnable(variant)
    seg, w = weights("Q8_0", n, k, seed=131, pack=pack)
    bias = rand(n, seed=132)
    for m in range(1, 18):
        x = rand(m, k, seed=133 + m)
        y = native.qmatmul(seg, w, x, bias, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, bias, plain=True, act_bits=8)), f"batch {m}"
        if m in (1, 4, 8, 9):  # each row as it comes out alone
            alone = torch.cat([native.qmatmul(seg, w, x[i : i + 1], bias, variant=variant, act_bits=8) for i in range(m)])
            assert torch.equal(y, alone), f"batch {m}"


def _extreme_q8_0_bytes(w: torch.Tensor) -> None:
    blocks = w.view(torch.uint8).view(-1, 34)
    blocks[:, 2:18] = 0x80  # -128
    blocks[:, 18:] = 0x7F


@VARIANTS
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "file-rows"])
def test_q8_0_extreme_bytes_stay_exact_at_every_direct_batch(variant: str, pack: bool) -> None:
    """Q8_0 bytes -128 / 127 against activations at +-127 at batches 1..9: the +128 offset
    (bytes + 128 up to 255, minus 128 x the block sum) stays exact in the direct strips' int32 lanes."""
    runnable(variant)
    seg, w = weights("Q8_0", 40, 576, seed=141, edit=_extreme_q8_0_bytes, pack=pack)
    for m in range(1, 10):
        x = torch.ones(m, 576) * torch.where(torch.arange(576) % 3 == 0, -1.0, 1.0)
        x[m // 2] *= -1.0
        y = native.qmatmul(seg, w, x, variant=variant, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, plain=True, act_bits=8)), f"batch {m}"
        assert torch.isfinite(y).all()


# batches around and above the amx build's AMX thresholds (q8amx.c AMX_MIN_K, AMX_MIN_PACKED,
# AMX_MIN_Q6K): one row short of a tile, whole tiles, a ragged last tile (M % 16)
KQUANT_AMX_BATCHES = (15, 16, 31, 32, 33, 47, 64, 100, 127, 128, 130)
# (K, N): passes of 4, 4 and 2 strips, the last a lone group, then 5 rows alone; 3 strips in one
# pass; 5 strips (4, then 1); one lone group and 3 rows alone; K = 3072, whose Q6_K panels fit 3
# strips per pass (q8amx.c PASS_BYTES): 3, 3 and a lone group (Q4_K / Q5_K: 4, then 3)
KQUANT_AMX_SHAPES = ((512, 8 * 19 + 5), (256, 48), (768, 80), (256, 11), (3072, 8 * 13 + 3))
_reference: dict[tuple[object, ...], torch.Tensor] = {}


def plain_reference(seg: tuple[tuple[str, int], ...], w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                    key: tuple[object, ...]) -> torch.Tensor:
    """The plain-C reference, computed once per key for every variant's case."""
    if key not in _reference:
        _reference[key] = native.qmatmul(seg, w, x, bias, plain=True, act_bits=8)
    return _reference[key]


@VARIANTS
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_strip_amx_batches_equal_the_plain_reference_bitwise(variant: str, qtype: str) -> None:
    """Q4_K / Q5_K / Q6_K, packed Q4_0 / Q4_1 and Q8_0 at batches around and above the AMX thresholds:
    on the amx build q8amx.c's strip_amx_rows (16 activation rows times passes of 1-4 strips of 16
    weight rows; Q6_K's halves folded into bfloat16 weights; Q8_0's +128 offset taken off C), elsewhere the vpdpbusd strips; ragged
    last tiles, lone last groups, N % 8 rows alone, with and without a bias: the plain-C
    reference's bits."""
    runnable(variant)
    for k, n in KQUANT_AMX_SHAPES:
        seg, w = weights(qtype, n, k, seed=151 + n)
        bias = rand(n, seed=152)
        for m in KQUANT_AMX_BATCHES:
            x = rand(m, k, seed=153 + m)
            b = bias if m % 2 else None
            y = native.qmatmul(seg, w, x, b, variant=variant, act_bits=8)
            assert torch.equal(y, plain_reference(seg, w, x, b, (qtype, k, n, m))), f"K {k} N {n} batch {m}"


@VARIANTS
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_extremes_stay_exact_at_amx_batches(variant: str, qtype: str) -> None:
    """The K-quants' largest terms against activations at +-127, at 1 and 4 rows (packed Q4_K /
    Q6_K: q8act.c's registers) and at batches on both sides of the AMX thresholds: Q4_K / Q5_K q = 15 / 31 with 6-bit scales and minimums 63; Q6_K q - 32 = -32 with
    its int8 scales -128 (w = sc (q - 32) = 4096, the bfloat16 split's largest: hi 4096, lo 0;
    |isum| up to 32 * 4096 * 127, just under 2^24), q - 32 = 31 with scales 127 (w = 3937: hi 3904
    + lo 33), and the two mixed byte by byte. Integer sums (and Q6_K's bfloat16 float sums) stay
    exact: the plain-C reference's bits."""
    runnable(variant)
    k, n = 768, 40
    g = torch.Generator().manual_seed(161)
    patterns = ("top",) if qtype != "Q6_K" else ("w4096", "w3937", "mixed")

    def extremes(raw: torch.Tensor) -> None:
        if qtype == "Q4_K":
            raw.view(-1, 144)[:, 4:] = 0xFF
        elif qtype == "Q5_K":
            raw.view(-1, 176)[:, 4:] = 0xFF
        else:
            blocks = raw.view(-1, 210)
            if pattern == "w4096":
                blocks[:, :192], blocks[:, 192:208] = 0, 0x80
            elif pattern == "w3937":
                blocks[:, :192], blocks[:, 192:208] = 0xFF, 0x7F
            else:
                blocks[:, :192] = torch.where(torch.rand(blocks.shape[0], 192, generator=g) < 0.5, 0, 0xFF).to(torch.uint8)
                blocks[:, 192:208] = torch.where(torch.rand(blocks.shape[0], 16, generator=g) < 0.5, 0x80, 0x7F).to(torch.uint8)

    for pattern in patterns:
        seg, w = weights(qtype, n, k, seed=162, edit=extremes)
        for m in (1, 4, 17, 33, 64, 130):
            for signs in ("same", "mixed"):
                x = torch.ones(m, k)
                if signs == "mixed":
                    x = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
                x[m // 2] *= -1.0
                y = native.qmatmul(seg, w, x, variant=variant, act_bits=8)
                assert torch.equal(y, native.qmatmul(seg, w, x, plain=True, act_bits=8)), f"{pattern} batch {m} {signs}"
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
    its int8 scales -128, the largest terms of its int32 fold), at 17 rows and at 130 (the amx
    build's AMX tiles, Q6_K's in bfloat16): the sums (and Q8_0's +128 offset) are exact, so still
    the reference's bits."""
    for qtype, rows in itertools.product(("Q4_1", "Q8_0", "Q4_K", "Q6_K"), (17, 130)):  # 130: the amx build's AMX tiles
        k = inputs(qtype, 576)

        def extremes(raw: torch.Tensor, qtype: str = qtype) -> None:  # the file layout's bytes, before packing
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

        seg, w = weights(qtype, 32, k, seed=121, edit=extremes)
        if qtype == "Q4_1":
            nib = w.view(-1, 20 * 8)  # packed: 8 rows' d, m, then 128 nibble bytes per block
            nib[:, 32:] = 0xFF
        x = torch.ones(rows, k) * torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
        y = native.qmatmul(seg, w, x, act_bits=8)
        assert torch.equal(y, native.qmatmul(seg, w, x, plain=True, act_bits=8))
        assert torch.isfinite(y).all()
