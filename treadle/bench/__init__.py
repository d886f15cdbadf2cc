"""Benchmarks: `treadle bench throughput|latency|serve` (see docs/benchmarks.md)."""
from treadle.config import TreadleError

# the backends `treadle bench throughput|latency` can run (bench/backends.py builds them; named
# here so the parser names them without importing torch)
BACKENDS = ("treadle", "treadle-nospec", "static", "hf", "llamacpp", "llamacpp-lookup", "llamacpp-hl",
            "llamacpp-server")


class BenchError(TreadleError, ValueError):
    """A benchmark asked for something it cannot run (a bad length, backend, workload or SLO):
    the CLI prints it as one line."""
