"""The API side of the process boundary: the ``EngineClient`` contract and ``OutputGroup``
(``engine_client.py``), ``AsyncLLM`` (``in_process.py``: the step loop on a thread of this
process) and ``EngineCoreClient`` (``multi_process.py``: the step loop in an engine-core process)."""
