"""``treadle doctor``: the report's fields, every runnable variant self-tested against the plain-C
build and passing, the override shown, and the decode steps at batch 1 / 4 / 16 (stories260k)."""
from __future__ import annotations

import json

import pytest

from treadle.entrypoints.cli import main
from treadle.kernels import native, selftest
from treadle.loaders import huge_pages

pytestmark = [pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
              pytest.mark.usefixtures("one_thread")]


def test_doctor_json_on_stories260k(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREADLE_CPU_KERNELS", raising=False)
    assert main(["doctor", "--model", "stories260k", "--json", "--threads", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cpu"]["threads"] == 1 and set(r["cpu"]["features"]) <= native.cpu_features()
    k = r["kernels"]
    assert k["selected"] == native.best_runnable() and k["override"] is None
    assert k["why"].startswith(f"{k['selected']} (the best variant this CPU runs")
    assert k["small_batches"] == ("256-bit register paths up to 4 rows (auto: AMD Zen 4)"
                                  if native.prefers_256_bit_small_batches() else "512-bit strips (auto)")
    assert k["weights_in_huge_pages"] == huge_pages.describe()
    assert list(k["variants"]) == [v.name for v in native.VARIANTS]
    for name, v in k["variants"].items():
        assert v["lacks"] == list(native.missing_features(name)) and v["runnable"] == (not v["lacks"])
    tested = {t["variant"] for t in r["self_tests"]}
    assert tested == set(selftest.runnable_variants()) and "plain" in tested
    assert r["all_self_tests_passed"] and all(t["passed"] and t["max_error"] <= t["limit"] for t in r["self_tests"])
    assert all(t["limit"] == 0 for t in r["self_tests"] if t["contract"] == "bit-exact")
    m = r["machine"]
    assert m["read_bandwidth_gb_s"] > 0 and m["torch_f32_matmul_gflop_s"] > 0
    assert m["int8_peak_gop_s"] > 0 and m["f32_peak_gflop_s"] > 0 and m["int8_instruction"]
    d = r["decode"]
    assert d["model"] == "stories260k" and set(d["step_ms"]) == {"1", "4", "16"}
    assert all(ms > 0 for ms in d["step_ms"].values())
    assert d["ratio_to_batch_1"]["16"] == pytest.approx(d["step_ms"]["16"] / d["step_ms"]["1"])


def test_doctor_table_names_a_forced_variant(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "plain")
    monkeypatch.setenv("TREADLE_SMALL_BATCH_PATH", "512")
    assert main(["doctor", "--no-decode"]) == 0
    out = capsys.readouterr().out
    assert f"kernels    plain (forced by TREADLE_CPU_KERNELS; the best this CPU runs: {native.best_runnable()})" in out
    assert "| plain | w8a8 int8 x int8 | bit-exact | 0 | 0 | pass |" in out
    assert "all self-tests passed" in out and "decode steps" not in out
    assert "small 8-bit batches (AVX-512 builds): 512-bit (forced by TREADLE_SMALL_BATCH_PATH)" in out


def test_doctor_refuses_a_bad_override_in_one_line(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "avx9")
    assert main(["doctor", "--no-decode"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: TREADLE_CPU_KERNELS='avx9' is not a kernel variant")
