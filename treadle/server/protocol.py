"""Request bodies of the OpenAI-compatible API (pydantic, strict types).

Strict mode: a string where a number belongs is a 400, not a silent coercion;
non-finite floats are refused. Range checks live in SamplingParams (one place),
except the few that only the server knows about (n, top_logprobs). A field this
server does not know is a 400 that names it (never silently dropped); a null value,
or one of vLLM's fields at its neutral default (``NEUTRAL``), counts as not sent.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

MAX_N = 128  # OpenAI's own limit on choices per request


def _check_unicode(value: Any) -> None:
    """JSON can carry lone surrogates (U+D800) that no tokenizer or UTF-8 encoder takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


def _whole_number(value: Any) -> Any:
    """JSON has one number type: 1.0 is the integer 1 (as JSON Schema says); 1.5 is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_number), Field(ge=-(2**63), le=2**63 - 1)]  # 64-bit, as the engine's


# vLLM request fields Treadle does not implement, at the values that ask for nothing
# beyond what Treadle does anyway; any other value of them is refused by name.
NEUTRAL: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "echo": False,
    "continue_final_message": False, "include_reasoning": True, "return_tokens_as_token_ids": False,
    "spaces_between_special_tokens": True,
}


def _neutral(key: str, value: Any) -> bool:
    if key not in NEUTRAL:
        return False
    default = NEUTRAL[key]
    return value == default and isinstance(value, bool) == isinstance(default, bool)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        if isinstance(data, dict):  # unknown fields that ask for nothing count as not sent
            known = {f.alias or name for name, f in cls.model_fields.items()} | set(cls.model_fields)
            data = {k: v for k, v in data.items()
                    if k in known or not (v is None or _neutral(k, v))}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's ``structured_outputs`` request field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Body):
    """The sampling fields both endpoints share."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int = -1
    min_p: float = 0.0
    n: Int = 1
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    # vLLM's extra sampling fields
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id (OpenAI): accepted, not used
    prompt_logprobs: Int | None = None  # vLLM: top-k logprobs of each prompt token, in each choice
    priority: Int = 0  # vLLM: lower is served first (scheduling policies priority and predicted)
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # P/D disaggregation (vLLM's name): passed to the engine as it is (treadle/kv_transfer)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage on every streamed chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


PromptField = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None
    add_special_tokens: bool = True  # vLLM: BOS etc. on text prompts

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, or token ids, each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it; tool-call arguments as objects (as
        Hermes/Qwen and Llama-3 templates expect) where they parse."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _maybe_json(c.function.arguments)}} for c in self.tool_calls]
        return msg


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM: special tokens on top of what the template writes
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int]


# -- response bodies (documentation for the OpenAPI spec; extra fields allowed) --------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(_Out):
    status: str


class LoadResponse(_Out):
    waiting_prompt_tokens: int
    running: int
    waiting: int
    kv_usage: float
    role: str | None  # the kv_role of kv_transfer_config; null without one
    predicted_remaining_tokens: int | None = None  # output tokens still predicted (length predictor); null without one
    max_num_seqs: int | None = None  # sequences the instance runs at once (its batch slots)


class VersionResponse(_Out):
    version: str


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int
    predicted_output_tokens: int | None = None  # the length predictor's answer for this prompt; null without one


class DetokenizeResponse(_Out):
    prompt: str
