"""What a speculative verify step costs against a plain decode step: one sequence's forward
with 1, 2, ... query rows at the end of a context (the rows a verify of K drafts runs: 1 + K),
layers (the one-call C layer takes up to ``DECODE_ROWS_MAX`` rows) and lm_head timed apart,
interleaved over repeats, medians (thread CPU time with one thread, so other jobs on a shared
machine disturb it less; wall time with more). ``PYTHONPATH=<other checkout>`` times that tree.

    python benchmarks/kernels/verify_rows_cpu.py --model smollm2-135m-instruct --threads 1

The ratio bounds what speculation can give at batch 1: with mean acceptance length L (tokens
per verify) and a verify of 1 + K rows costing r(1 + K) plain steps, the speed-up is at most
L / r(1 + K), and L <= 1 + K.
"""
from __future__ import annotations

import harness
import torch
from harness import Case

from treadle import LLM
from treadle.layers.attention import StepInputBuilder


class RowsStep:
    """One sequence's forward of ``rows`` query rows at the end of ``context`` cached tokens: the
    layers (``layers``) and then the lm_head over their output (``lm_head``), timed as two cases."""

    def __init__(self, runner, builder: StepInputBuilder, table: list[int], context: int, rows: int) -> None:  # noqa: ANN001
        self.model, self.kv, self.rows = runner.model, runner.kv_caches, rows
        self.builder, self.table, self.context = builder, table, context
        self.hidden: torch.Tensor | None = None

    def inputs(self) -> None:
        self.positions, self.meta = self.builder.build([self.rows], [self.context + self.rows], [self.table])
        self.meta.plan = self.model.backend.plan(self.meta)
        self.ids = torch.randint(100, self.model.config.vocab_size, (self.rows,))

    def layers(self) -> None:
        self.hidden = self.model(self.ids, self.positions, self.kv, self.meta)

    def lm_head(self) -> None:
        self.model.compute_logits(self.hidden)


def main() -> None:
    ap = harness.parser(__doc__, repeats=15, warmup=0, threads=1)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--rows", default="1,2,3,5,8,9,13,16")
    args = ap.parse_args()
    run = harness.start(args)
    rows = [int(r) for r in args.rows.split(",")]
    llm = LLM(args.model, max_model_len=args.context + max(rows) + 16, kv_cache_memory="64MiB")
    runner = llm.engine.model_runner()
    builder = StepInputBuilder(runner.block_size)
    table = list(range(-(-(args.context + max(rows)) // runner.block_size)))
    cases = []
    for q in rows:
        step = RowsStep(runner, builder, table, args.context, q)
        cases += [Case(f"layers {q}", step.layers, before=step.inputs), Case(f"lm_head {q}", step.lm_head)]
    with torch.inference_mode():
        t = run.time(cases)  # per round: layers then lm_head of each row count in turn
    med = {q: (t.median(f"layers {q}") * 1e3, t.median(f"lm_head {q}") * 1e3) for q in rows}
    plain = sum(med[rows[0]])
    run.table(["rows", "layers ms", "lm_head ms", f"step / {rows[0]}-row step"],
              [[q, f"{med[q][0]:.1f}", f"{med[q][1]:.1f}", f"{sum(med[q]) / plain:.2f}"] for q in rows])
    run.finish()


if __name__ == "__main__":
    main()
