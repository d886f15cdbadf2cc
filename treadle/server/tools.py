"""Tool calling on /v1/chat/completions: which tools the template sees, the grammar that
forces a well-formed call, and the model's output parsed into OpenAI ``tool_calls``.

    tool_choice    template gets tools   output constrained to            parsed as
    none           no                    -                                content
    auto           yes                   -                                Hermes/Qwen <tool_call>{json}</tool_call>,
                                                                          Llama-3 JSON {"name", "parameters"}, or content
    required       yes                   [{"name", "arguments"}, ...]     that array
    {function}     yes                   that function's arguments        one call of it
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from treadle.server.errors import APIError
from treadle.server.protocol import ChatCompletionRequest, NamedToolChoice
from treadle.server.structured import StructuredRequest
from treadle.structured import StructuredOutputsParams

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama-3.1 writes it before a JSON call
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # OpenAI tool definitions, for the chat template
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    """None: no tool handling (no tools, or tool_choice "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError.bad_request("tool_choice requires tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in body.tools]
        if choice.function.name not in names:
            raise APIError.bad_request(f"tool_choice names the function {choice.function.name!r}, which is not "
                                       f"among the tools ({', '.join(names)})", "tool_choice")
        return ToolMode("named", tools, choice.function.name, body.parallel_tool_calls)
    return ToolMode(choice or "auto", tools, None, body.parallel_tool_calls)


def _parameters(mode: ToolMode, name: str) -> dict[str, Any]:
    fn = next(t["function"] for t in mode.tools if t["function"]["name"] == name)
    return fn.get("parameters") or _ANY_OBJECT


def forced_request(mode: ToolMode) -> StructuredRequest | None:
    """The structured output that makes a required / named call well formed."""
    if mode.choice == "named" and mode.name is not None:
        return StructuredRequest(StructuredOutputsParams(json=_parameters(mode, mode.name)), "tool_choice")
    if mode.choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": _parameters(mode, t["function"]["name"])},
              "required": ["name", "arguments"], "additionalProperties": False} for t in mode.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not mode.parallel:
        schema["maxItems"] = 1
    return StructuredRequest(StructuredOutputsParams(json=schema), "tool_choice")


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], args)


def parse_tool_calls(mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output. Forced modes parse what the grammar
    made; auto looks for Hermes tags, then a Llama-3 JSON call; anything else is content."""
    if mode.choice == "named" and mode.name is not None:
        return None, [tool_call(mode.name, text)]
    if mode.choice == "required":
        try:
            calls = [c for obj in json.loads(text) if (c := _as_call(obj)) is not None]
        except (json.JSONDecodeError, TypeError):  # cut by max_tokens
            return text, []
        return None, calls
    return _parse_auto(text)


def _parse_auto(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    if HERMES_OPEN in text:
        calls = []
        for m in _HERMES.finditer(text):
            try:
                call = _as_call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if calls:
            content = text[: text.index(HERMES_OPEN)].strip()
            return content or None, calls
        return text, []
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if body.startswith("{"):
        calls = []
        for part in body.split(";"):
            try:
                call = _as_call(json.loads(part))
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return None, calls
    return text, []


def streamable(mode: ToolMode, text: str) -> int:
    """How much of an unfinished output is surely content (streamed at once); the rest may
    be a tool call and waits for the end."""
    if mode.forced:
        return 0
    head = text.lstrip()
    if not head or head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
        return 0
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
