"""A tiny end-to-end `treadle bench throughput` / `latency` run (never timed)."""
from __future__ import annotations

import json

import pytest

from treadle.entrypoints.cli import main

WORKLOAD = ["--input-len", "8:24", "--output-len", "2:4", "--num-prompts", "4", "--workload-seed", "3"]


def test_bench_throughput_side_by_side(tiny_llama, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama), "--backends", "treadle,static,hf",
               "--concurrency", "1,3", "--repeats", "1", "--no-roofline", "--save-result", str(out), *WORKLOAD])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| 3    | static" in table and "vs treadle " in table
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert {(r["backend"], r["concurrency"]) for r in runs} == {(b, c) for b in ("treadle", "static", "hf")
                                                                 for c in (1, 3)}
    expected_out = None
    for r in runs:
        m = r["metrics"]
        assert m["completed"] == 4 and m["failed"] == 0
        expected_out = expected_out or m["total_output_tokens"]
        assert m["total_output_tokens"] == expected_out  # every backend yields exactly output_len tokens
        if r["backend"] in ("treadle", "static"):
            kv = r["kv"]
            assert 0 < kv["used_slots_at_peak"] <= kv["peak_allocated_slots"] <= kv["total_slots"]
    assert result["workload"]["kind"] == "random"


def test_bench_latency_with_roofline(tiny_llama, tmp_path, capsys):
    rc = main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "16", "--output-len", "4",
               "--iters", "2", "--save-result", str(tmp_path / "lat.json")])
    assert rc == 0
    assert "decode / BW bound" in capsys.readouterr().out
    rows = json.loads((tmp_path / "lat.json").read_text())["rows"]
    assert rows[0]["backend"] == "treadle" and rows[0]["decode_fraction"] > 0


def test_bench_latency_other_checkpoint_beside_the_model(tiny_llama, tmp_path, capsys):
    """``treadle@MODEL``: another checkpoint of the same vocabulary (a quantized one, say) in the
    same run as --model's."""
    other = f"treadle+int8@{tiny_llama}"
    rc = main(["bench", "latency", "--model", str(tiny_llama), "--backends", f"treadle,{other}", "--input-len", "16",
               "--output-len", "4", "--iters", "2", "--no-roofline", "--save-result", str(tmp_path / "lat.json")])
    assert rc == 0
    rows = json.loads((tmp_path / "lat.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["treadle", other]


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--output-len", "-1"], "need 1 <= LO <= HI"),
    (["--input-len", "8:4"], "need 1 <= LO <= HI"),
    (["--backends", "nope"], "unknown backend 'nope'"),
    (["--backends", "hf+int8"], "only treadle and static take a +QUANTIZATION"),
])
def test_bench_mistakes_are_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--model", "stories260k", "--num-prompts", "2", "--threads", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["bench", "throughput", "--num-prompts", "0"], ["bench", "latency", "--iters", "0"],
                                  ["generate", "--threads", "-1", "hi"], ["serve", "--max-seqs-per-request", "0"],
                                  ["serve", "--max-request-bytes", "-1"]])
def test_counts_below_one_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "is less than 1" in capsys.readouterr().err
