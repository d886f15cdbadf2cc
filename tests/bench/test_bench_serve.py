"""`treadle bench serve` end to end against a real Treadle server on 127.0.0.1."""
from __future__ import annotations

import json

import pytest
from server_harness import serve

from treadle.bench.workloads import LengthRange, WorkloadSpec, make_workload
from treadle.entrypoints.cli import main

pytestmark = pytest.mark.server  # starts processes (servers, workers)


def test_bench_serve_against_real_server(tiny_llama, tmp_path, capsys):
    out = tmp_path / "serve.json"
    with serve(tiny_llama) as (srv, _llm):
        rc = main(["bench", "serve", "--base-url", f"treadle={srv.url}", "--model", str(tiny_llama),
                   "--num-prompts", "6", "--input-len", "8:24", "--output-len", "3:6", "--workload-seed", "5",
                   "--request-rate", "50", "--max-concurrency", "3", "--goodput", "ttft:600000", "tpot:600000",
                   "--save-result", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Time per Output Token" in printed and "Request goodput" in printed
    (result,) = json.loads(out.read_text())["results"]
    m = result["metrics"]
    assert result["label"] == "treadle" and result["model"] == "tiny"
    assert (m["completed"], m["failed"]) == (6, 0)
    reqs = make_workload(WorkloadSpec("random", 6, LengthRange(8, 24), LengthRange(3, 6), seed=5), 258)
    assert m["total_output_tokens"] == sum(r.output_len for r in reqs)  # ignore_eos honoured, usage counted
    assert m["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert m["request_goodput"] == m["request_throughput"]  # generous SLOs: every request is good
    assert 1 <= m["max_concurrency_seen"] <= 3
    assert m["ttft_ms"]["median"] > 0 and m["itl_ms"]["mean"] > 0
