"""PNG charts (matplotlib, the optional ``[plot]`` extra): throughput against
concurrency per backend, and latency CDFs (TTFT, TPOT) per backend."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from treadle.bench.metrics import RequestRecord, Spread


def _pyplot():  # noqa: ANN202
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'treadle[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(
    curves: Mapping[str, Sequence[tuple[int, Spread]]], path: Path, title: str, ylabel: str = "output tokens/s"
) -> Path:
    """One line per backend: median over repeats, bars from min to max."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, points in curves.items():
        pts = sorted(points)
        xs = [c for c, _ in pts]
        med = np.array([s.median for _, s in pts])
        err = np.array([[s.median - s.lo for _, s in pts], [s.hi - s.median for _, s in pts]])
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight / static batch size)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency_cdfs(records: Mapping[str, Sequence[RequestRecord]], path: Path, title: str) -> Path:
    """TTFT and TPOT empirical CDFs side by side, one curve per backend."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
    for name, recs in records.items():
        ok = [r for r in recs if r.success and r.chunk_times]
        series = {
            "TTFT (ms)": [r.ttft * 1000 for r in ok],
            "TPOT (ms)": [t * 1000 for t in (r.tpot for r in ok) if t is not None],
        }
        for ax, (label, values) in zip(axes, series.items()):
            if not values:
                continue
            xs = np.sort(values)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
            ax.set_xlabel(label)
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
