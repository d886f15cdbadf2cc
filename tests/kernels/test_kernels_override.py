"""``TREADLE_CPU_KERNELS``: the automatic choice of the C kernels' variant overridden, every
variant this CPU runs forced in turn, and the refusals (an unknown name lists the valid ones; a
variant the CPU lacks names the missing features) as one-line errors, not tracebacks."""
from __future__ import annotations

import pytest
from gguf_files import random_blocks
from kernel_variants import VARIANTS, force, rand

from treadle.config import TreadleError
from treadle.entrypoints import cli
from treadle.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)")


@VARIANTS
def test_a_forced_variant_is_the_one_every_kernel_call_runs(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    force(monkeypatch, variant)
    assert native.describe().startswith(f"{variant} (forced by TREADLE_CPU_KERNELS; the best this CPU runs: "
                                        f"{native.best_runnable()})")
    blocks = random_blocks("Q4_K", 8, 256, seed=3)
    x, seg, w = rand(3, 256, seed=4), (("Q4_K", 8),), blocks.data.reshape(-1)
    assert native.kernel("tq_matmul") is native.kernel("tq_matmul", variant=variant)
    assert native.qmatmul(seg, w, x).equal(native.qmatmul(seg, w, x, variant=variant))


def test_auto_and_unset_choose_the_best_runnable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "auto")
    assert native.selected_variant() == native.best_runnable()
    monkeypatch.delenv("TREADLE_CPU_KERNELS")
    assert native.selected_variant() == native.best_runnable()
    assert "forced" not in native.describe()


def test_an_unknown_name_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "avx1024")
    with pytest.raises(TreadleError) as err:
        native.selected_variant()
    assert str(err.value) == ("TREADLE_CPU_KERNELS='avx1024' is not a kernel variant; choose one of "
                              f"{', '.join(v.name for v in native.VARIANTS)} (or auto)")


@VARIANTS
def test_a_variant_the_cpu_lacks_is_refused_naming_the_missing_features(variant: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2-only CPU (the features given), and on this machine where it lacks the variant."""
    avx2_only = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
    needs = next(v.needs for v in native.VARIANTS if v.name == variant)
    lacking = [f for f in needs if f not in avx2_only]
    if lacking:
        with pytest.raises(TreadleError, match=f"^TREADLE_CPU_KERNELS={variant}: this CPU lacks {' '.join(lacking)}, "
                                               "which that variant needs$"):
            native.check_runnable(variant, avx2_only)
    else:
        native.check_runnable(variant, avx2_only)
    missing = native.missing_features(variant)
    monkeypatch.setenv("TREADLE_CPU_KERNELS", variant)
    if missing:
        with pytest.raises(TreadleError, match=" ".join(missing)):
            native.selected_variant()
    else:
        assert native.selected_variant() == variant


def test_the_cli_prints_one_line_not_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "nope")
    assert cli.main(["generate", "--model", "stories260k", "--max-tokens", "2", "Once"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: TREADLE_CPU_KERNELS='nope' is not a kernel variant; choose one of ")
    assert "Traceback" not in "\n".join(err)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: TREADLE_CPU_KERNELS='nope'")
