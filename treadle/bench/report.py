"""Result tables (plain text, also valid Markdown) and the JSON result file."""
from __future__ import annotations

import dataclasses
import json
import math
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from treadle.bench.metrics import ServeMetrics


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def fmt_ratio(value: float, ref: float) -> str:
    if not ref or math.isnan(value) or math.isnan(ref):
        return "-"
    return f"{value / ref:.2f}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def serve_report(label: str, m: ServeMetrics, traffic: str) -> str:
    """The per-run block, laid out like `vllm bench serve` prints it."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", str(m.completed)), ("Failed requests", str(m.failed)),
        ("Traffic", traffic), ("Peak concurrent requests", str(m.max_concurrency_seen)),
        ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", str(m.total_input_tokens)), ("Total generated tokens", str(m.total_output_tokens)),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
    ]
    if m.request_goodput is not None:
        rows.append(("Request goodput (req/s)", f"{m.request_goodput:.2f}"))
    rows += [("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
             ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}")]
    out = [f"{' ' + label + ' ':=^54}"] + [f"{k + ':':<40}{v:>14}" for k, v in rows]
    for title, name, dist in (("Time to First Token", "TTFT", m.ttft_ms),
                              ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
                              ("Inter-token Latency", "ITL", m.itl_ms), ("End-to-end Latency", "E2EL", m.e2el_ms)):
        out.append(f"{' ' + title + ' ':-^54}")
        out.append(f"{'Mean ' + name + ' (ms):':<40}{dist.mean:>14.2f}")
        out.append(f"{'Median ' + name + ' (ms):':<40}{dist.median:>14.2f}")
        out += [f"{p.upper() + ' ' + name + ' (ms):':<40}{v:>14.2f}" for p, v in dist.percentiles.items()]
    out.append("=" * 54)
    return "\n".join(out)


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.machine(),
            "processor": platform.processor(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "git_commit": commit}


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def save_result(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable({"environment": environment(), **result}), indent=2))
    return path
