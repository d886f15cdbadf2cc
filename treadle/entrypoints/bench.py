"""`treadle bench {throughput,latency,serve}`; the work lives in treadle.bench."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from treadle.bench.cli import register as register_bench

    register_bench(sub)
