"""Runtime dispatch of the C kernels' builds (``native.VARIANTS``): every variant this CPU can
run is checked against the plain-C reference build and the dequantized oracle; variants it
cannot run are skipped with the features it lacks; every variant must at least compile.
A row's result must not depend on its batch: bit for bit at batch 1 and batch 16."""
from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks
from kernel_variants import VARIANTS, rand, runnable

from treadle.kernels import native
from treadle.quantization.methods.gguf_native import NATIVE_TYPES, dequantize_blocks

K = 512  # two K-quant super-blocks per row
N = 37  # odd: a segment's last row goes alone
pytestmark = [pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
              pytest.mark.usefixtures("sixteen_bit_activations")]  # the 8-bit path: test_q8_activations.py


def q16(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round activations: 16 bits per block of 32."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 32767
    return (torch.round(b * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))) * d).reshape(x.shape)


@VARIANTS
def test_every_variant_compiles(variant: str) -> None:
    """Built even where the CPU cannot run it (nothing of it is called then)."""
    assert native.build_variant(variant) is not None


def test_processes_building_one_variant_at_once_build_it_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two builders of the same variant on a cold cache (the ranks of a multi-process engine's
    first start): one compiles, the other waits for its library and loads it."""
    built = native.build_variant("plain")
    assert built is not None
    calls: list[Path] = []

    def slow_build(compiler: str, flags: tuple[str, ...], sources: list[Path], target: Path) -> None:
        calls.append(target)
        time.sleep(0.5)  # the other builder arrives meanwhile
        shutil.copy(built._name, target)

    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_build", slow_build)
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda _: native.build_variant.__wrapped__("plain"), range(2)))
    assert len(calls) == 1 and all(lib is not None for lib in libs)


def test_the_best_runnable_variant_is_selected_and_described(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREADLE_CPU_KERNELS", raising=False)  # tests/test_kernels_override.py forces one
    best = next(v.name for v in native.VARIANTS if not native.missing_features(v.name))
    assert native.selected_variant() == best
    line = native.describe()
    assert line.startswith(best)
    for v in native.VARIANTS[: [v.name for v in native.VARIANTS].index(best)]:
        assert f"{v.name} (CPU lacks {' '.join(native.missing_features(v.name))})" in line


@VARIANTS
@pytest.mark.parametrize("qtype", NATIVE_TYPES)
def test_variant_matches_reference_and_oracle(variant: str, qtype: str) -> None:
    runnable(variant)
    blocks = random_blocks(qtype, N, K, seed=7)
    w = blocks.data.reshape(-1)
    w_deq = dequantize_blocks(blocks)
    bias = rand(N, seed=8)
    for rows in (1, 5, 16):
        x = rand(rows, K, seed=9 + rows)
        y = native.qmatmul(((qtype, N),), w, x, bias, variant=variant)
        ref = native.qmatmul(((qtype, N),), w, x, bias, plain=True)
        oracle = F.linear(q16(x), w_deq, bias)
        tol = float(oracle.abs().max()) * 1e-5  # float32 summation order differs between builds
        torch.testing.assert_close(y, ref, rtol=0, atol=tol)
        torch.testing.assert_close(y, oracle, rtol=0, atol=tol)


@VARIANTS
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q4_K", "Q6_K", "Q2_K"])
def test_rows_are_bitwise_equal_at_batch_1_and_16(variant: str, qtype: str) -> None:
    runnable(variant)
    blocks = random_blocks(qtype, N, K, seed=11)
    w, seg = blocks.data.reshape(-1), ((qtype, N),)
    x = rand(16, K, seed=12)
    batch = native.qmatmul(seg, w, x, variant=variant)
    for i in range(16):
        assert torch.equal(native.qmatmul(seg, w, x[i : i + 1], variant=variant)[0], batch[i])
    # and wherever a row sits in the batch
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(13))
    assert torch.equal(native.qmatmul(seg, w, x[perm], variant=variant), batch[perm])


def test_simd_variants_agree_bit_for_bit() -> None:
    """The SIMD builds differ only in how the exact integer dot products are formed."""
    simd = [v.name for v in native.VARIANTS if v.name != "plain" and not native.missing_features(v.name)]
    if len(simd) < 2:
        pytest.skip(f"needs two runnable SIMD variants, this CPU runs {simd or 'none'}")
    blocks = random_blocks("Q4_1", N, K, seed=14)
    x = rand(9, K, seed=15)
    outs = [native.qmatmul((("Q4_1", N),), blocks.data.reshape(-1), x, variant=v) for v in simd]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@VARIANTS
@pytest.mark.parametrize("k", [64, 100, 200])
def test_w8a8_variant_is_exact(variant: str, k: int) -> None:
    """W8A8 (csrc/w8a8.c) in every variant: the exact int32 sums of the torch reference, bit for
    bit, -128 activations and weights included (the VNNI build offsets activations to u8)."""
    from treadle.quantization.methods.w8a8 import w8a8_reference

    runnable(variant)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=gen) * torch.rand(9, 1, generator=gen) * 4
    x[:, 0] = -x.abs().amax(1)  # each token's largest magnitude is negative: quantizes to -128
    w = torch.randint(-128, 128, (N, k), generator=gen, dtype=torch.int8)
    w[:3] = -128  # rows at the int8 extreme: -128 * -128 in every product
    scale, bias = torch.rand(N, generator=gen) * 0.01, rand(N, seed=k)
    want = w8a8_reference(x, w, scale, bias)
    assert torch.equal(native.w8a8_matmul(x, w, scale, bias, variant=variant), want)
    for i in (0, 5):
        assert torch.equal(native.w8a8_matmul(x[i : i + 1], w, scale, bias, variant=variant)[0], want[i])


def test_w8a8_vnni_path_is_compiled_into_the_vnni_build() -> None:
    """The avx512-vnni build's W8A8 product really is vpdpbusd (compiled here even where the
    CPU cannot run it), and the AVX2 build's is not."""
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(native.__file__).parent / "csrc" / "w8a8.c"

    def assembly(variant: str) -> str:
        flags = next(v.flags for v in native.VARIANTS if v.name == variant)
        cmd = [compiler, "-O3", "-fopenmp", "-std=c11", "-D_GNU_SOURCE", *flags, "-S", "-o", "-", str(source)]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout

    assert "vpdpbusd" in assembly("avx512-vnni")
    assert "vpdpbusd" in assembly("avx-vnni")  # the VEX form (Intel CPUs without AVX-512)
    assert "vpdpbusd" not in assembly("avx2")
