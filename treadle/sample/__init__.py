"""Turning logits into tokens, for the runner and for speculation alike.

    sampler.py           (Sampler, SamplingRow) penalties, temperature, top-k / top-p / min-p,
                         seeded draws, greedy argmax, the logprobs a request asked for
    rejection_sampler.py (verify) the target's logits at 1 + K rows against K drafts ->
                         the accepted drafts plus one token, drawn with the same Sampler

Both worker/ (the model runner) and spec_decode/ (proposers that take a greedy argmax) stand
on this package; it stands on core's plain step data and the sampling parameters only.
"""
