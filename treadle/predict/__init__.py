"""Output-length prediction for cost-aware scheduling (issue 33; docs/scheduling.md).

Contract: ``LengthPredictor.predict(prompts)`` takes prompts as token-id lists and returns
the expected number of output tokens of each, from the prompt alone, cheaply enough to run at
admission in the engine process (numpy only, no target model, no torch). The engine puts the
number on the request (``Request.predicted_output_tokens``); the scheduler's
``core/cost_policy.py`` only ever sees that plain number.

Modules: ``model.py`` (features, inference, the on-disk format), ``training.py`` (the fit:
pairwise ranking loss + a log-length anchor, in torch; Kendall's tau), ``prompt_set.py`` (the
templated prompt set whose answers range from one word to several hundred tokens).

Why a separate tiny model rather than a head on the target's last hidden state: it needs no
prefill to have run, so a request is ranked the moment it arrives (the queue forms before
prefill), and the router and bench can run the same predictor without the model.
"""
