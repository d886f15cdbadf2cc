"""Per-app server state: the engine, the limits one request may not exceed, and the
admission checks every generation request passes before it reaches the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treadle.engine.client.engine_client import EngineClient, OutputGroup
from treadle.server.errors import APIError
from treadle.server.metrics import ServerMetrics
from treadle.tokenizer import Tokenizer

if TYPE_CHECKING:
    from treadle.structured.probe import CompileProbe

DEFAULT_MAX_SEQS_PER_REQUEST = 512
DEFAULT_MAX_LOGPROB_ENTRIES = 500_000  # ~300 MB at most in the API process (docs/serving.md)
DEFAULT_STREAM_STALL_TIMEOUT_S = 30.0
DEFAULT_MAX_GRAMMAR_COMPILE_S = 10.0  # 1,000 optional properties compile in ~4 s on 2 cores
DEFAULT_MAX_GRAMMAR_BYTES = 64 << 10
_MIN_REQUEST_BYTES = 1 << 20
_REQUEST_BYTES_PER_TOKEN = 128  # a token as JSON text or as an id in a list, generously


def default_max_request_bytes(max_model_len: int) -> int:
    """Room for a few full-length prompts as text or token ids, and never under 1 MiB."""
    return max(_MIN_REQUEST_BYTES, max_model_len * _REQUEST_BYTES_PER_TOKEN)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may ask for. ``max_waiting``: new requests get 503 (Retry-After)
    while admitting them would put more than this many sequences in the waiting queue.
    ``max_seqs_per_request``: prompts x n of one request (400 above). ``max_request_bytes``:
    body size (413 above; None: sized from max_model_len). ``max_logprob_entries``: the
    logprob entries one request may ask for (400 above; see backpressure.py).
    ``stream_stall_timeout``: seconds a streaming client may read nothing before its
    request is aborted. ``max_grammar_compile_s`` / ``max_grammar_bytes``: the time a
    structured-output spec may take to compile (in a child process, killed at the deadline)
    and its size (400 above either; see treadle/structured/probe.py)."""

    max_waiting: int | None = None
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    max_request_bytes: int | None = None
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT_S
    max_grammar_compile_s: float = DEFAULT_MAX_GRAMMAR_COMPILE_S
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES


@dataclass
class ServerState:
    llm: EngineClient
    served_model_name: str
    metrics: ServerMetrics
    limits: ServerLimits = ServerLimits()
    api_key: str | None = None
    draining: bool = False
    open_groups: set[OutputGroup] = field(default_factory=set)  # admitted and not yet released
    grammar_probe: CompileProbe | None = None  # built on first use (server/structured.py)

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this has more than max_model_len tokens, whatever it says."""
        return self.llm.max_model_len * self.tokenizer("prompt").max_token_chars

    def tokenizer(self, param: str) -> Tokenizer:
        """The tokenizer, or a 400 on ``param`` when the server runs without one."""
        if self.llm.tokenizer is None:
            raise APIError.bad_request(f"{param} needs a tokenizer, and this server was started with "
                                       "--skip-tokenizer-init; send token ids instead", param)
        return self.llm.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{self.served_model_name}`", "model", "model_not_found")

    def check_admitting(self) -> None:
        """503 at once while draining or while the engine is dead or stuck."""
        if self.draining:
            raise APIError.unavailable("the server is shutting down", "shutting_down")
        if not self.llm.is_alive():
            raise APIError.unavailable(f"the engine is not running ({self.llm.dead_error})", "engine_dead")
        problem = self.llm.health()
        if problem is not None:
            raise APIError.unavailable(f"the engine is unhealthy: {problem}", "engine_unhealthy")

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        cap = self.limits.max_seqs_per_request
        if num_prompts * n > cap:
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences; this server "
                                f"takes at most {cap} per request", "n", "too_many_sequences")

    def abort_open(self, error: BaseException) -> int:
        """End every admitted request with ``error`` (drain timeout); returns how many."""
        groups = list(self.open_groups)
        for group in groups:
            group.fail(error)
        return len(groups)
