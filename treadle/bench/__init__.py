"""Benchmarks: `treadle bench throughput|latency|serve` (see docs/benchmarks.md)."""
