"""Per-request sampling parameters (names follow vLLM's SamplingParams)."""
from __future__ import annotations

import json as jsonlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, cast

from treadle.config import InvalidRequestError

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (as vLLM): logits / T would overflow
MIN_REPETITION_PENALTY = 0.01  # below it, a seen token's logit / penalty can overflow float32
INT64 = (-(2**63), 2**63 - 1)  # what the engine's messages and torch's seeds can carry
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed")
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_PARAM = "structured_outputs"


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's names), as plain data: exactly one of
    ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (EBNF in xgrammar's dialect: ``root ::= ...``) or ``json_object``
    (any JSON object). It travels inside SamplingParams to the workers, so it holds only
    strings, lists and bools; ``key`` names the compiled grammar in caches."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"structured output needs exactly one of {', '.join(_KINDS)}; "
                                      f"got {', '.join(given) or 'none'}", STRUCTURED_PARAM)
        if isinstance(self.json, dict):
            self.json = jsonlib.dumps(self.json)  # property order is generation order: keep it
        checks = [
            (self.json is None or isinstance(self.json, str), "json must be a JSON schema (an object or its text)"),
            (self.regex is None or isinstance(self.regex, str), "regex must be a string"),
            (self.grammar is None or isinstance(self.grammar, str), "grammar must be a string"),
            (self.choice is None or (isinstance(self.choice, list) and len(self.choice) > 0
                                     and all(isinstance(c, str) for c in self.choice)),
             "choice must be a non-empty list of strings"),
            (isinstance(self.json_object, bool), "json_object must be a boolean"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message, STRUCTURED_PARAM)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "choice":
            return kind, jsonlib.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))


class SamplingParamsError(InvalidRequestError):
    """An out-of-range sampling parameter; ``param`` names it (for HTTP 400 bodies)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param)


@dataclass
class SamplingParams:
    """What one request samples with (vLLM's names and defaults). A temperature below 1e-5 is
    greedy; integers must fit in 64 bits; ``repetition_penalty`` is at least 0.01. Out-of-range
    or mistyped values raise ``SamplingParamsError`` naming the parameter."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this grammar
    # P/D disaggregation (vLLM's name): {"do_remote_decode": true} to a producer, the producer's
    # answer ({"do_remote_prefill": true, ...}) to a consumer; see treadle/kv_transfer
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise SamplingParamsError("stop", f"stop must be a string or a list of strings, not {self.stop!r}")
        self.stop = [s for s in (self.stop or []) if s != ""]
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_types()
        self._validate()

    def _check_types(self) -> None:
        """Finite numbers and whole ints, checked before any range check compares them."""
        for name in _FLOATS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise SamplingParamsError(name, f"{name} must be a finite number, not {value!r}")
        for name in _INTS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise SamplingParamsError(name, f"{name} must be an integer, not {value!r}")
            if value is not None and not INT64[0] <= value <= INT64[1]:
                raise SamplingParamsError(name, f"{name} must fit in 64 bits, not {value}")
        if not all(_is_int(t) and 0 <= t <= INT64[1] for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be non-negative integers")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not all(isinstance(s, str) for s in cast(list[object], self.stop)):  # a list since __post_init__
            raise SamplingParamsError("stop", "stop must be a string or a list of strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "n must be at least 1"),
            (self.temperature >= 0.0, "temperature", "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (
                self.repetition_penalty >= MIN_REPETITION_PENALTY,
                "repetition_penalty",
                f"repetition_penalty must be at least {MIN_REPETITION_PENALTY}",
            ),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must not exceed max_tokens",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        if self.structured_outputs is not None:  # the grammar ends the output with a stop token
            checks.append((not self.ignore_eos, "ignore_eos", "ignore_eos cannot be combined with structured output"))
            checks.append((self.min_tokens == 0, "min_tokens", "min_tokens cannot be combined with structured output"))
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
