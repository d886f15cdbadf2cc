"""The structured-output work the runner adds to one decode step, measured alone: GrammarMatchers.mask
(fill each constrained row's bitmask, apply it) + accept, for 1 and 32 constrained rows on SmolLM2's
49k vocabulary, inside a JSON string (the bulk of a JSON answer). Compare with the step time.

    PYTHONPATH=$PWD python benchmarks/structured_mask_cost.py
"""
import statistics
import time

import torch

from treadle.loaders import open_model_source
from treadle.sampling_params import StructuredOutputsParams
from treadle.structured.matchers import GrammarMatchers

torch.set_num_threads(1)
src = open_model_source("smollm2-135m-instruct")
schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}
tok = src.tokenizer
doc = tok.encode('{"story": "' + "Once upon a time there was a little cat who loved to play in the garden. " * 4, add_special_tokens=False)
for batch in (1, 32):
    g = GrammarMatchers(lambda: src.grammars)
    rids = [str(i) for i in range(batch)]
    for r in rids:
        g.add(r, StructuredOutputsParams(json=schema), [2])
    times = []
    for t in doc:
        logits = torch.randn(batch, src.config.vocab_size)
        t0 = time.perf_counter()
        g.mask(logits, rids)
        for r in rids:
            g.accept(r, t)
        times.append(time.perf_counter() - t0)
    print(f"batch {batch}: mask+accept per step median {statistics.median(times)*1e3:.2f} ms over {len(doc)} steps")
