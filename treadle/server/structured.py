"""The structured-output request fields of both endpoints -> one StructuredOutputsParams.

Accepted (at most one per request): OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object, and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, NamedTuple

from treadle.config import InvalidRequestError
from treadle.server.errors import APIError
from treadle.server.protocol import SamplingFields
from treadle.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from treadle.server.state import ServerState
    from treadle.structured.probe import CompileProbe

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


_probe_lock = threading.Lock()


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


def grammar_probe(state: ServerState) -> CompileProbe:
    """The server's compile probe (built on the first structured request, in a worker thread)."""
    from treadle.structured.compiler import tokenizer_info
    from treadle.structured.probe import CompileProbe

    with _probe_lock:
        if state.grammar_probe is None:
            cfg = state.llm.model_config
            info = tokenizer_info(state.tokenizer("structured_outputs"), cfg.vocab_size, cfg.stop_token_ids)
            state.grammar_probe = CompileProbe(info.serialize_json(), state.limits.max_grammar_compile_s,
                                               state.limits.max_grammar_bytes, info.vocab_size)
        return state.grammar_probe


def check_compile_budget(state: ServerState, structured: StructuredRequest,
                         left: threading.Event | None = None) -> None:
    """In a worker thread: a 400 naming --max-grammar-bytes or --max-grammar-compile-s when the
    spec is too large or, being large, does not compile in time (in a child process that is
    killed at the deadline), or naming the spec's problem. The engine then compiles it: the
    only compile of a small spec (most), a second one, known to fit, of a large one."""
    if structured.spec.kind == "json_object":  # one fixed, tiny grammar
        return
    try:
        grammar_probe(state).check(structured.spec, left)
    except InvalidRequestError as e:
        raise APIError.bad_request(str(e), structured.param) from None
