"""`treadle bench comm` starts two real ranks over gloo and reports, per step size and overlap
mode, the step with and without its collectives, the collectives alone, and the % hidden."""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys

import pytest

from treadle.bench.comm import hidden_percent


def test_hidden_percent_is_the_share_of_comm_that_did_not_add_time() -> None:
    assert hidden_percent(with_comm=10.0, compute=10.0, comm=4.0) == 100.0  # fully hidden
    assert hidden_percent(with_comm=14.0, compute=10.0, comm=4.0) == 0.0  # fully exposed
    assert hidden_percent(with_comm=11.0, compute=10.0, comm=4.0) == 75.0
    assert math.isnan(hidden_percent(1.0, 1.0, 0.0))


@pytest.mark.server
def test_bench_comm_reports_both_modes_for_each_step_size() -> None:
    # its own session, so that the rank processes it starts go with it whatever happens
    proc = subprocess.Popen([sys.executable, "-m", "treadle.entrypoints.cli", "bench", "comm", "--model", "stories260k",
                             "--tokens", "8", "--rounds", "1", "--repeats", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone: nothing left running
            pass
        proc.wait(timeout=10)
    assert proc.returncode == 0, stderr[-2000:]
    rows = re.findall(r"^\| 8 \| (off|on) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (-?\d+|nan) \|$", stdout, re.M)
    assert [r[0] for r in rows] == ["off", "on"], stdout
    for _, with_comm, compute, comm, _hidden in rows:
        assert float(with_comm) > 0 and float(compute) > 0 and float(comm) > 0
