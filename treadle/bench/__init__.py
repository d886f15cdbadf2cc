"""Benchmarks: `treadle bench throughput|latency|serve` (see docs/benchmarks.md)."""
from treadle.config import TreadleError


class BenchError(TreadleError, ValueError):
    """A benchmark asked for something it cannot run (a bad length, backend, workload or SLO):
    the CLI prints it as one line."""
