"""Speculative decoding, in three pieces kept apart (design guide, principle 9):

    proposer            (proposer.py: the contract; ngram.py, draft_model.py,
                         head_proposers.py: EAGLE / Medusa heads, heads.py, head_format.py)
                                               the runner hands it the step, gets K drafts per request
    verifier            (sample/rejection_sampler.py) the runner's target logits at the 1 + K rows ->
                                               the accepted drafts plus one token
    fallback controller (core/spec_fallback.py) torch-free, in the scheduler's package: whether drafts
                                               are scheduled at all (per request, per batch size)

The scheduler only reserves lookahead slots: a speculating request's target is its tokens
plus its drafts, so the 1 + K query tokens join the same flat SplitFuse batch as prompt
chunks and plain decodes; rejected drafts roll back by winding ``num_computed_tokens`` back
and freeing the blocks that held only them (``KVCacheManager.trim``).

    step t:   schedule [last token, d1 .. dK] --> runner: logits at 1+K rows
              --> verify: accepted d1..da + one token (correction or bonus)
              --> propose next drafts from prompt + output --> ModelRunnerOutput
    update:   computed += 1 + a; blocks past the computed length are freed; drafts kept on
              the request for step t+1 (dropped when the controller says it does not pay)
"""
