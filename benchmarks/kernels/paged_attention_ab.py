"""The C paged attention kernel (``tq_paged_decode``) of this tree against a git ref's, on the same
inputs, calls interleaved (both through ctypes): a prompt's rows (every token a row of the kernel,
as the CPU backend runs a prompt) and decode rows (batch x context), with the bits of the two
builds compared. The A/B for a change to ``csrc/paged_attention.c``.

    .venv/bin/python benchmarks/kernels/paged_attention_ab.py --ref REF [--threads 2]
        [--shapes 32x4 9x3] [--head-dim 64] [--cache float32 bfloat16 int8] [--prompt 512]
        [--decode 1x160 4x160 16x160 16x1000]

Shapes are query heads x KV heads (32x4: TinyLlama-1.1B; 9x3: SmolLM2-135M; 4x1 with
``--head-dim 256``: Gemma 3 270M), blocks of 16, every sequence's blocks scattered.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import harness
import torch
from harness import Case

from treadle.kernels import header, native
from treadle.kernels.attention import KV_FORMATS
from treadle.layers.attention.kv_quant import quantize

BS = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def rows_case(lens: list[int], tables: list[list[int]], heads: tuple[int, int], d: int, dtype: torch.dtype,
              g: torch.Generator) -> Callable[[object], torch.Tensor]:
    """A call of the kernel ``fn`` over rows of these context lengths and block tables (the rows'
    K/V already in the cache: nothing written); returns its output."""
    h, hkv = heads
    blocks = max(max(t) for t in tables) + 1
    caches = []
    for _ in "kv":
        x = torch.randn(blocks, BS, hkv, d, generator=g)
        caches.append(quantize(x, dtype) if dtype is torch.int8 else x.to(dtype))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    r = len(lens)
    q, kv = torch.randn(r, h, d, generator=g), torch.zeros(r, hkv, d)
    slots = torch.full((r,), -1, dtype=torch.int64)
    fmt = KV_FORMATS[dtype][0]

    def call(fn) -> torch.Tensor:  # noqa: ANN001
        out = torch.empty(r, h, d)
        fn(q.data_ptr(), kv.data_ptr(), kv.data_ptr(), q.stride(0), kv.stride(0), kv.stride(0), caches[0].data_ptr(),
           caches[1].data_ptr(), slots.data_ptr(), table.data_ptr(), seq_lens.data_ptr(), r, width, BS, h, hkv, d, 0,
           d**-0.5, fmt, out.data_ptr())
        return out
    return call


def main() -> None:
    ap = harness.parser(__doc__, repeats=21, threads=2, clock="wall")
    ap.add_argument("--ref", required=True, help="the git ref whose kernels to time beside this tree's")
    ap.add_argument("--shapes", nargs="+", default=["32x4", "9x3"])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cache", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--prompt", type=int, nargs="*", default=[512])
    ap.add_argument("--decode", nargs="*", default=["1x160", "4x160", "16x160", "16x1000"])
    args = ap.parse_args()
    run = harness.start(args)
    new = native.kernel("tq_paged_decode")
    old = harness.build_ref(args.ref, Path(tempfile.mkdtemp())).tq_paged_decode
    old.argtypes, old.restype = header.argtypes("tq_paged_decode"), None
    table = run.table(["shape", "cache", "rows", "this tree ms", f"{args.ref} ms", "time ratio", "same bits"],
                      title="ms per call, median (time ratio = this tree / ref)")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        heads = tuple(int(x) for x in shape.split("x"))
        for cache in args.cache:
            cases = [(f"prompt {n}", list(range(1, n + 1)), [list(range(1, -(-n // BS) + 1))] * n) for n in args.prompt]
            for bc in args.decode:
                b, ctx = (int(x) for x in bc.split("x"))
                nb = -(-ctx // BS)
                perm = torch.randperm(b * nb, generator=g).add(1).tolist()  # scattered blocks
                cases.append((f"decode {bc}", [ctx] * b, [perm[i * nb:(i + 1) * nb] for i in range(b)]))
            for label, lens, tables in cases:
                call = rows_case(lens, tables, heads, args.head_dim, DTYPES[cache], g)
                same = torch.equal(call(new), call(old))
                t = run.time([Case("new", lambda call=call: call(new)), Case("old", lambda call=call: call(old))])
                table.add([shape, cache, label, t.median("new") * 1e3, t.median("old") * 1e3,
                           f"{t.ratio('new', 'old'):.2f}", same])
    run.finish()


if __name__ == "__main__":
    main()
