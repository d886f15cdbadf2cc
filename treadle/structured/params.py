"""StructuredOutputsParams: what a request's output must match (vLLM's names), as plain data.

Exactly one of ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice``
(a list of strings), ``grammar`` (EBNF in xgrammar's dialect: ``root ::= ...``) or
``json_object`` (any JSON object). It travels inside SamplingParams to the workers, so it
holds only strings, lists and bools; ``key`` names the compiled grammar in caches.
"""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

from treadle.config import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
PARAM = "structured_outputs"


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"structured output needs exactly one of {', '.join(_KINDS)}; "
                                      f"got {', '.join(given) or 'none'}", PARAM)
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
                raise InvalidRequestError(message, PARAM)

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
