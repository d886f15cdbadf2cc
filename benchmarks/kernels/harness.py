"""The one harness of the kernel micro-benchmarks (the scripts beside it): each times a kernel or
op in isolation, never the whole engine (that is ``treadle bench``).

    ap = harness.parser(__doc__, repeats=15, threads=1)   # --repeats --warmup --threads --clock --json
    ap.add_argument("--batches", ...)                      # the script's own options
    run = harness.start(ap.parse_args())                   # threads set, the machine line printed
    t = run.time([Case("new", fn), Case("old", old_fn)])   # interleaved: new, old, new, old, ...
    table = run.table(["case", "ms", "x old"], title="median ms per call")  # the head now ...
    table.add(["new", t.median("new") * 1e3, t.ratio("new", "old")])   # ... each row as it comes
    run.finish()                                           # --json PATH: the machine and every table

``Run.time`` calls every case once per warm-up round, then takes ``--repeats`` rounds of one
timed call per case in turn (round robin), so a busy or drifting machine slows every case alike;
``Timings`` gives the median (or the best) seconds per call and each case's ratio of medians to
a named baseline case. The clock: ``auto`` is thread CPU time at one thread (other jobs on a
shared machine then disturb it less) and wall time with more; ``wall``, ``thread`` or
``process`` force one. The machine line names the CPU model, its SIMD features (the ones
``treadle doctor`` reports), the torch threads, the clock and the kernel variant chosen.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[2]
CLOCKS: dict[str, tuple[str, Callable[[], float]]] = {
    "wall": ("wall", time.perf_counter), "thread": ("thread CPU", time.thread_time),
    "process": ("process CPU", time.process_time)}


@dataclass(frozen=True)
class Case:
    """One named thing to time. ``fn`` makes ``calls`` calls of the op (samples are per call);
    ``before`` runs untimed right before each call of ``fn`` (e.g. a backend switch)."""

    name: str
    fn: Callable[[], object]
    calls: int = 1
    before: Callable[[], object] | None = None


@dataclass(frozen=True)
class Timings:
    """Seconds per call of each case, in the order the rounds took them."""

    samples: dict[str, list[float]]

    @property
    def names(self) -> list[str]:
        return list(self.samples)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def best(self, name: str) -> float:
        return min(self.samples[name])

    def ratio(self, name: str, baseline: str) -> float:
        """``name``'s median over ``baseline``'s (> 1: slower than the baseline)."""
        return self.median(name) / self.median(baseline)


class Clock(NamedTuple):
    name: str
    now: Callable[[], float]


def clock_for(choice: str, threads: int) -> Clock:
    """``auto``: thread CPU time at one thread, wall time with more."""
    if choice == "auto":
        choice = "thread" if threads == 1 else "wall"
    return Clock(*CLOCKS[choice])


def interleave(cases: Sequence[Case], repeats: int, warmup: int, clock: Callable[[], float]) -> Timings:
    """``warmup`` untimed rounds, then ``repeats`` timed rounds, each calling every case once in turn."""
    samples: dict[str, list[float]] = {c.name: [] for c in cases}
    if len(samples) != len(cases):
        raise ValueError(f"case names must differ: {[c.name for c in cases]}")
    for _ in range(warmup):
        for c in cases:
            if c.before is not None:
                c.before()
            c.fn()
    for _ in range(repeats):
        for c in cases:
            if c.before is not None:
                c.before()
            t = clock()
            c.fn()
            samples[c.name].append((clock() - t) / c.calls)
    return Timings(samples)


def machine() -> dict[str, Any]:
    """The CPU model, its SIMD features, logical CPUs, torch threads and the kernel variant, as
    ``treadle doctor`` reports them (a tree on PYTHONPATH older than the doctor: the bare platform)."""
    try:
        from treadle.bench.doctor import cpu_info
        from treadle.kernels import native

        return {**cpu_info(), "kernels": native.describe()}
    except (ImportError, AttributeError):
        return {"model": platform.processor() or platform.machine(), "features": [], "logical_cpus": os.cpu_count(),
                "threads": torch.get_num_threads(), "kernels": "unknown (no treadle doctor in this tree)"}


def parser(doc: str | None, *, repeats: int = 15, warmup: int = 1, threads: int | None = 1,
           clock: str = "auto") -> argparse.ArgumentParser:
    """The options every kernel micro-benchmark shares; the script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=repeats, help="timed rounds (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed rounds first (default %(default)s)")
    ap.add_argument("--threads", type=int, default=threads,
                    help="torch threads (default: " + (str(threads) if threads else "torch's own") + ")")
    ap.add_argument("--clock", choices=["auto", *CLOCKS], default=clock,
                    help="auto: thread CPU time at one thread, wall time with more (default %(default)s)")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the tables here")
    return ap


@dataclass
class Table:
    """A markdown table being printed row by row (floats to ``digits`` places)."""

    columns: list[str]
    title: str | None
    digits: int
    rows: list[list[object]] = field(default_factory=list)

    def add(self, row: Sequence[object]) -> None:
        print("| " + " | ".join(f"{v:.{self.digits}f}" if isinstance(v, float) else str(v) for v in row) + " |",
              flush=True)
        self.rows.append(list(row))


@dataclass
class Run:
    """One benchmark run: its options, clock and machine, and the tables printed so far."""

    args: argparse.Namespace
    clock: Clock
    machine: dict[str, Any]
    tables: list[Table] = field(default_factory=list)

    def time(self, cases: Sequence[Case], repeats: int | None = None, warmup: int | None = None) -> Timings:
        return interleave(cases, self.args.repeats if repeats is None else repeats,
                          self.args.warmup if warmup is None else warmup, self.clock.now)

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[object]] = (), title: str | None = None,
              digits: int = 3) -> Table:
        """Print a markdown table's head and ``rows``; ``Table.add`` prints more rows as they come.
        Its raw values go into --json."""
        table = Table(list(columns), title, digits)
        self.tables.append(table)
        if title:
            print(f"\n{title}")
        print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
        for row in rows:
            table.add(row)
        return table

    def finish(self) -> None:
        if self.args.json is not None:
            options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()}
            self.args.json.write_text(json.dumps({"command": sys.argv, "options": options, "machine": self.machine,
                                                  "clock": self.clock.name,
                                                  "tables": [asdict(t) for t in self.tables]}, indent=1))
            print(f"wrote {self.args.json}")


def start(args: argparse.Namespace) -> Run:
    """Set torch's threads, choose the clock, print the machine line."""
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    run = Run(args, clock_for(args.clock, threads), machine())
    m = run.machine
    print(f"cpu {m['model']} ({m['logical_cpus']} logical); simd {' '.join(m['features']) or 'none'}; "
          f"threads {threads}; clock {run.clock.name}; kernels {m['kernels']}")
    return run


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random GGUF blocks of ``qtype`` as one flat uint8 tensor (the tests' maker, tests/gguf_files.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_files import random_blocks as make

    return make(qtype, rows, cols, seed=seed).data.reshape(-1)


def build_ref(ref: str, out: Path) -> ctypes.CDLL:
    """The C kernels of git ref ``ref``, built into ``out`` with the flags of this tree's chosen build."""
    csrc = out / "csrc"
    csrc.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:treadle/kernels/csrc"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{ref}:treadle/kernels/csrc/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (csrc / name).write_text(text)
    return _compile(csrc, out / "ref.so")


def build_with(cflags: str, out: Path) -> ctypes.CDLL:
    """This tree's C kernels built into ``out`` with its chosen build's flags plus ``cflags`` (e.g.
    ``-DAMX_MIN_PACKED=1``: a threshold or switch of the sources tried without editing them)."""
    from treadle.kernels import native

    return _compile(Path(native.__file__).parent / "csrc", out / "with.so", tuple(cflags.split()))


def _compile(csrc: Path, target: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The sources in ``csrc`` built as the engine builds its own (native._build: each file compiled
    at once, then linked) with this tree's chosen variant's flags plus ``extra``."""
    from treadle.kernels import native

    variant = native.selected_variant() or "plain"
    flags = (*native._FLAGS, *native._BY_NAME[variant].flags, *extra)  # noqa: SLF001  (the same build as this tree's)
    native._build("gcc", flags, sorted(csrc.glob("*.c")), target)  # noqa: SLF001
    return ctypes.CDLL(str(target))
