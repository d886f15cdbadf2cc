"""The GPU check scripts a lent GPU runs (benchmarks/gpu_check.py, benchmarks/gpu_engine_check.py)
still run: their reduced CPU modes, each in a process of its own, end with every check ok. A GPU
lease is short; a script broken since the last one would spend it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # a process each
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args,summary", [
    (["benchmarks/gpu_check.py", "--cpu-smoke"], "6/6 checks ok"),
    (["benchmarks/gpu_engine_check.py", "--device", "cpu", "--quick", "--only", "kernels", "families"],
     "9/9 checks ok"),
], ids=["gpu_check", "gpu_engine_check"])
def test_the_gpu_check_runs_in_its_cpu_mode(args: list[str], summary: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert summary in done.stdout
