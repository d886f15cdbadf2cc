"""The structured-output request fields of both endpoints -> one StructuredOutputsParams.

Accepted (at most one per request): OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object, and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from treadle.config import InvalidRequestError
from treadle.server.errors import APIError
from treadle.server.protocol import SamplingFields
from treadle.structured import StructuredOutputsParams

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


class StructuredRequest(NamedTuple):
    spec: StructuredOutputsParams
    param: str  # the body field that asked for it (errors point there)


def _asked(body: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(body field, StructuredOutputsParams fields) for each way the body asks."""
    asked: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError.bad_request("response_format of type json_schema needs json_schema.schema",
                                       "response_format")
        asked.append(("response_format", {"json": rf.json_schema.schema_}))
    so = body.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": bool(so.json_object)}
        asked.append(("structured_outputs", {k: v for k, v in fields.items() if v not in (None, False)}))
    asked.extend((name, {kind: getattr(body, name)}) for name, kind in _GUIDED if getattr(body, name) is not None)
    return asked


def structured_request(body: SamplingFields) -> StructuredRequest | None:
    """The body's one structured-output spec (None: free text); two ways at once, or a
    malformed spec, is a 400 naming the field."""
    asked = _asked(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError.bad_request(f"give one structured-output field, not both {asked[0][0]} and {asked[1][0]}",
                                   asked[1][0])
    param, fields = asked[0]
    try:
        return StructuredRequest(StructuredOutputsParams(**fields), param)
    except InvalidRequestError as e:
        raise APIError.bad_request(str(e), param) from None
