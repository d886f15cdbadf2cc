"""The structured-output work the runner adds to one decode step, measured alone: GrammarMatchers.mask
(fill each constrained row's bitmask, apply it) + accept, for 1 and 32 constrained rows on SmolLM2's
49k vocabulary, inside a JSON string (the bulk of a JSON answer). Compare with the step time.

    .venv/bin/python benchmarks/kernels/structured_mask_cost.py [--repeats STEPS]   (default: every token of the document)
"""
from __future__ import annotations

import harness
import torch
from harness import Case

from treadle.loaders import open_model_source
from treadle.sampling_params import StructuredOutputsParams
from treadle.structured.matchers import GrammarMatchers

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}


class ConstrainedRows:
    """``batch`` rows under one JSON schema, walking the same document token by token: each call
    masks fresh random logits (made untimed, in ``logits``) and accepts the next token."""

    def __init__(self, src, batch: int, doc: list[int]) -> None:  # noqa: ANN001
        self.matchers, self.vocab = GrammarMatchers(lambda: src.grammars), src.config.vocab_size
        self.rids, self.tokens = [str(i) for i in range(batch)], iter(doc)
        for r in self.rids:
            self.matchers.add(r, StructuredOutputsParams(json=SCHEMA), [2])

    def logits(self) -> None:
        self.next = torch.randn(len(self.rids), self.vocab)

    def step(self) -> None:
        self.matchers.mask(self.next, self.rids)
        token = next(self.tokens)
        for r in self.rids:
            self.matchers.accept(r, token)


def main() -> None:
    ap = harness.parser(__doc__, repeats=0, warmup=0, threads=1, clock="wall")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    run = harness.start(args)
    src = open_model_source("smollm2-135m-instruct")
    text = '{"story": "' + "Once upon a time there was a little cat who loved to play in the garden. " * 4
    doc = src.tokenizer.encode(text, add_special_tokens=False)
    steps = min(args.repeats or len(doc), len(doc) - args.warmup)
    walks = {b: ConstrainedRows(src, b, doc) for b in args.batches}
    t = run.time([Case(f"batch {b}", w.step, before=w.logits) for b, w in walks.items()], repeats=steps)
    run.table(["rows", "mask+accept ms per step (median)", "steps"],
              [[name, t.median(name) * 1e3, steps] for name in t.names], digits=2)
    run.finish()


if __name__ == "__main__":
    main()
