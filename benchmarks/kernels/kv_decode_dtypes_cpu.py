"""The C decode kernel alone (write + attention of one layer) over a float32, a bfloat16, an int8 and
an fp8 (e4m3) KV cache, side by side: SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64,
block 16) on random caches, several caches per timed pass (>= 96 MB, more than the L3) as a
step's 30 layers are; "x30" is a whole step's attention. Medians, ratios to float32.

    .venv/bin/python benchmarks/kernels/kv_decode_dtypes_cpu.py --batch 16 --context 1000 [--threads 1]

(The engine-level figure, decode steps with each ``--kv-cache-dtype``, is
benchmarks/kv_cache_dtype_cpu.py.)
"""
from __future__ import annotations

from collections.abc import Callable

import harness
import torch
from harness import Case

from treadle.kernels.attention import paged_decode
from treadle.layers.attention import build_attention_metadata
from treadle.layers.attention.cpu import build_plan
from treadle.layers.attention.kv_quant import quantize

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def cases(batch: int, context: int) -> list[Case]:
    """One case per cache dtype: a pass of the kernel over each of its caches."""
    g = torch.Generator().manual_seed(0)
    need = -(-context // BS)
    perm = torch.randperm(batch * need + 4, generator=g).tolist()
    tables = [perm[i * need : (i + 1) * need] for i in range(batch)]
    shape = (len(perm), BS, HKV, D)
    copies = max(1, min(16, -(-(96 << 20) // (2 * 4 * torch.Size(shape).numel()))))
    floats = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(copies)]
    caches = {"float32": floats, "bfloat16": [(k.bfloat16(), v.bfloat16()) for k, v in floats]}
    for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        caches[name] = [(quantize(k, dtype), quantize(v, dtype)) for k, v in floats]
    qkv = torch.randn(batch, (H + 2 * HKV) * D, generator=g)
    q, k, v = (x.view(batch, -1, D) for x in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
    plan = build_plan(build_attention_metadata([1] * batch, [context] * batch, tables, BS))
    assert plan.decode is not None and plan.decode.kernel_args is not None
    args = plan.decode.kernel_args

    def layer_pass(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            for kc, vc in pairs:
                assert paged_decode(q, k, v, kc, vc, *args, D**-0.5) is not None
        return run

    return [Case(name, layer_pass(pairs), calls=len(pairs)) for name, pairs in caches.items()]


def main() -> None:
    ap = harness.parser(__doc__, repeats=7, warmup=0, threads=None, clock="wall")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1000, help="tokens per sequence")
    args = ap.parse_args()
    run = harness.start(args)
    t = run.time(cases(args.batch, args.context))
    run.table(["cache", "ms/layer", "x30 ms", "ratio"],
              [[name, t.median(name) * 1e3, t.median(name) * LAYERS * 1e3, f"{t.ratio(name, 'float32'):.2f}"]
               for name in t.names], digits=2,
              title=f"C decode kernel, batch {args.batch} x context {args.context}, SmolLM2 shapes, median")
    run.finish()


if __name__ == "__main__":
    main()
