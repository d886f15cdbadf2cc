"""The router: one OpenAI-compatible front for many Treadle instances (`treadle router`).

Two modes, one code path:

```
 --backend A B          client ──> router ──> A or B (colocated: prompt + decode)

 --prefill P --decode D client ──> router ──1──> P   (max_tokens 1, do_remote_decode)
                                        <──2──  kv_transfer_params
                                   router ──3──> D   (the client's request + kv_transfer_params)
                                        <──4──  the answer (streamed through as is)
```

- ``instances.py``: what the router knows of each instance (health, the load it last
  reported on ``/load`` or ``/metrics``, the router's own in-flight counts) and the poller
  that keeps it fresh.
- ``policy.py``: pure choice functions: prefill by queued prompt tokens, decode / backend
  by running requests and KV usage, and prefix affinity.
- ``forward.py``: the upstream calls with timeouts and retries (a request that has not
  produced anything yet is retried on another instance).
- ``app.py``: the FastAPI app (routes, errors, /health, /metrics).

The router imports neither torch nor the engine: it speaks HTTP, plus one ZeroMQ message, the
KV connector's release (``treadle.kv_transfer.release``), sent to a producer whose prompt KV
no decode instance will pull.
"""
