"""The GGUF matmul on SmolLM2-135M's shapes at batch 1 / 4 / 16, this tree's kernels with 16-bit
and with 8-bit activations (csrc/q8act.c) against a git ref's (default ``main``; ``--ref none``:
this tree only), side by side in one process, interleaved call by call.

    .venv/bin/python benchmarks/qmatmul_batch_cpu.py [--ref main] [--threads 1]

Per shape and batch: the median over repeats of one ``tq_matmul`` call (thread CPU time with
one thread, so other jobs on a shared machine disturb it less; wall time with more), and the
per-token total of a decode step's matmuls (30 layers x q/k/v, o, gate/up, down + the Q8_0
lm_head), with its ratio to the first batch (``--batches 1 16 512``: other sizes). Weights are
random blocks (tests/gguf_files.py) that stay in cache, so this is the kernels' arithmetic, not
memory bandwidth; ``--cold`` gives each shape as many distinct weights as a step has (30 per layer
shape), called in turn, so a step's 92 MB come from memory as in a real decode step. A ref's kernels run with 16-bit and with 8-bit activations too; "a8 packed" is
this tree's 8-bit path on Q4 rows packed as a load with ``TREADLE_ACTIVATION_BITS=8`` packs them.
Builds whose packing gives the same bytes read the same copy of the weights: with a copy each, the
same source built twice read 576x1536 at M = 1 up to 20 % apart on the Zen 1 machine (where the
copies landed). A ref whose packed layout differs still reads its own copy, with that bias.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from gguf_files import random_blocks  # noqa: E402

from treadle.kernels import native  # noqa: E402

# (name, block type, N, K, times per decode step)
SHAPES = [("qkv", "Q4_1", 960, 576, 30), ("o", "Q4_1", 576, 576, 30), ("gate_up", "Q4_1", 3072, 576, 30),
          ("down", "Q4_1", 576, 1536, 30), ("lm_head", "Q8_0", 49152, 576, 1)]
BATCHES = (1, 4, 16)


def build_ref(ref: str, out: Path) -> ctypes.CDLL:
    """The kernels of git ref ``ref``, built with the flags this tree's default build uses."""
    csrc = out / "csrc"
    csrc.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:treadle/kernels/csrc"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{ref}:treadle/kernels/csrc/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (csrc / name).write_text(text)
    target = out / "ref.so"
    variant = native.selected_variant() or "plain"
    flags = (*native._FLAGS, *native._BY_NAME[variant].flags)  # noqa: SLF001  (the same build as this tree's)
    cmd = ["gcc", *flags, *map(str, sorted(csrc.glob("*.c"))), "-o", str(target), "-lm"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(target))


def caller(lib: ctypes.CDLL, bits: int, qtype: str, w: torch.Tensor, n: int, k: int, x: torch.Tensor):  # noqa: ANN201
    fn = lib.tq_matmul
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    lay = native.layout(((qtype, n),), bits)  # a ref without act_bits reads the fields before it
    y = torch.empty(x.shape[0], n)
    args = (ctypes.addressof(lay), w.data_ptr(), x.data_ptr(), y.data_ptr(), None, x.shape[0], n, k)
    return lambda: fn(*args) or y  # holds y (the kernel writes into it)


def pack_copies(libs: list[ctypes.CDLL], qtype: str, ws: list[torch.Tensor], n: int,
                k: int) -> dict[ctypes.CDLL, list[torch.Tensor]]:
    """Per library, the weight copies packed by its own tq_q8_pack (the layout may differ); a
    library whose bytes equal another's reads that one's copies (see the docstring). Empty for
    types that are not packed."""
    packed: dict[ctypes.CDLL, list[torch.Tensor]] = {}
    if qtype not in native.PACKED.values():
        return packed
    for lib in dict.fromkeys(libs):
        mine = [w.clone() for w in ws]
        lib.tq_q8_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        for wp in mine:
            lib.tq_q8_pack(native.QTYPES[qtype], wp.data_ptr(), n, k)
        same = (p for p in packed.values() if all(torch.equal(a, b) for a, b in zip(p, mine)))
        packed[lib] = next(same, mine)
    return packed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--cold", action="store_true", help="distinct weights per layer, read from memory")
    args = ap.parse_args()
    batches = tuple(args.batches)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        this = native.library()
        libs = {"this tree a16": (this, 16, False), "this tree a8": (this, 8, False),
                "this tree a8 packed": (this, 8, True)}
        if args.ref != "none":
            ref = build_ref(args.ref, Path(tmp))
            libs = {f"{args.ref} a16": (ref, 16, False), f"{args.ref} a8": (ref, 8, False),
                    **({f"{args.ref} a8 packed": (ref, 8, True)} if hasattr(ref, "tq_q8_pack") else {}), **libs}
        print(f"threads {args.threads}, median ms per call ({'thread CPU' if args.threads == 1 else 'wall'} time)")
        print("| shape | build | " + " | ".join(f"M={m}" for m in batches) + " |")
        print("|---|---|" + "---|" * len(batches))
        step = {name: dict.fromkeys(batches, 0.0) for name in libs}
        for shape, qtype, n, k, per_step in SHAPES:
            copies = per_step if args.cold else 1
            ws = [random_blocks(qtype, n, k, seed=1 + c).data.reshape(-1) for c in range(copies)]
            packed = pack_copies([lib for lib, _, pack in libs.values() if pack], qtype, ws, n, k)
            ptype = next((p for p, b in native.PACKED.items() if b == qtype), qtype)
            times: dict[str, dict[int, float]] = {name: {} for name in libs}
            for m in batches:
                x = torch.randn(m, k)
                fns = {name: [caller(lib, bits, *((ptype, packed[lib][c]) if pack and lib in packed else (qtype, w)),
                                     n, k, x) for c, w in enumerate(ws)]
                       for name, (lib, bits, pack) in libs.items()}
                samples: dict[str, list[float]] = {name: [] for name in libs}
                for calls in fns.values():
                    calls[0]()
                for _ in range(args.repeats):
                    for name, calls in fns.items():  # interleaved: both see the same machine load
                        t = clock()
                        for fn in calls:
                            fn()
                        samples[name].append((clock() - t) / copies)
                for name in libs:
                    times[name][m] = statistics.median(samples[name]) * 1e3
                    step[name][m] += times[name][m] * per_step
            for name in libs:
                print(f"| {shape} {qtype} {n}x{k} | {name} | " + " | ".join(f"{times[name][m]:.3f}" for m in batches) + " |")
        for name in libs:
            cells = " | ".join(f"{step[name][m]:.2f} ({step[name][m] / step[name][batches[0]]:.2f}x)" for m in batches)
            print(f"| decode-step matmuls | {name} | {cells} |")


if __name__ == "__main__":
    main()
