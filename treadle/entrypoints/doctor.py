"""`treadle doctor`: the CPU, the kernel variant chosen and why, every runnable variant's
self-test against the plain-C reference, bandwidth and peaks, and the decode step at batch
1 / 4 / 16 (see treadle.bench.doctor for what each figure is and how it is measured)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from treadle.engine.args import EngineArgs
from treadle.engine.cli_args import positive_int


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("doctor", help="what the CPU kernels do on this machine: variant, self-tests, peaks",
                              description="Prints the CPU's features, the kernel variant chosen and why "
                              "(TREADLE_CPU_KERNELS overrides it), every runnable variant's self-test against the "
                              "plain-C build, read bandwidth, int8 and float32 peaks, and the decode step of MODEL "
                              "at batch 1 / 4 / 16 with their ratios. Exit status 1 when a self-test fails.")
    p.add_argument("--model", default=EngineArgs.model, help="model whose decode steps are timed (default: %(default)s)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode steps (no model is loaded)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch / OpenMP threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from treadle.bench import doctor

    report = doctor.run(None if args.no_decode else args.model, args.threads)
    print(json.dumps(report) if args.json else doctor.format_report(report))
    return 0 if report["all_self_tests_passed"] else 1
