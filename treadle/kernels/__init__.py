"""Treadle's own CPU kernels: small C files compiled for this machine on first use."""
