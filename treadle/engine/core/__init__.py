"""The engine side of the process boundary: ``EngineCore`` (what is done to an LLMEngine),
``CoreLoop`` (the one step loop) and its ``CoreTransport`` contract (``loop.py``), the
engine-core process with its ZeroMQ transport (``process.py``) and the wire (``messages.py``)."""
