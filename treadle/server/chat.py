"""POST /v1/chat/completions: messages through the model's chat template, n choices,
streamed as server-sent events or returned whole; OpenAI's chat logprobs shape."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from treadle.config import TreadleError
from treadle.engine.inputs import PromptType
from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.server.errors import APIError
from treadle.server.generation import GenerationView, prompt_logprobs_json
from treadle.server.openapi import GENERATION_RESPONSES
from treadle.server.protocol import ChatCompletionRequest, ChatCompletionResponse, ChatMessage
from treadle.server.state import ServerState
from treadle.server.structured import StructuredRequest
from treadle.server.tools import HERMES_OPEN, forced_request, parse_tool_calls, streamable, tool_mode
from treadle.tokenizer import Tokenizer

router = APIRouter()


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template applied to ``messages`` (the text holds any BOS the template writes)."""
    if not messages:
        raise APIError.bad_request("messages must not be empty", "messages")
    try:
        return tokenizer.apply_chat_template([m.as_template_input() for m in messages], add_generation_prompt,
                                             tools)
    except TreadleError as e:
        raise APIError.bad_request(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template tripping over user content is the user's 400
        raise APIError.bad_request(f"chat template failed on these messages: {e}", "messages") from None


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _ChatView(request.app.state.treadle, body).respond(request)


def _entry(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> dict[str, Any]:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}"""
    content = []
    for tid, entry in zip(ids, entries):
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda lp: lp.rank or 0)
        content.append({**_entry(entry[tid]), "top_logprobs": [_entry(lp) for lp in top]})
    return {"content": content}


class _ChatView(GenerationView):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"
    body: ChatCompletionRequest

    def __init__(self, state: ServerState, body: ChatCompletionRequest) -> None:
        super().__init__(state, body)
        self.tools = tool_mode(body)
        self._streamed: dict[int, int] = {}  # content characters sent, per choice (tool mode)

    def structured_request(self) -> StructuredRequest | None:
        asked = super().structured_request()
        if self.tools is None:
            return asked
        forced = forced_request(self.tools)
        if forced is not None and asked is not None:
            raise APIError.bad_request(f"tool_choice {self.tools.choice!r} cannot be combined with {asked.param}",
                                       asked.param)
        return forced or asked

    def sampling_params(self) -> SamplingParams:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError.bad_request("top_logprobs must be in [0, 20]", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            return self.make_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        except APIError as e:  # name the field the client sent
            if e.param == "max_tokens" and body.max_completion_tokens is not None:
                e.param, e.message = "max_completion_tokens", e.message.replace("max_tokens", "max_completion_tokens")
            raise

    def num_prompts(self) -> int:
        return 1

    def prompts(self) -> list[PromptType]:
        text = render_chat(self.state.tokenizer("messages"), self.body.messages, self.body.add_generation_prompt,
                           self.tools.tools if self.tools is not None else None)
        return [self.tokenized(text, add_special_tokens=self.body.add_special_tokens)]

    def response_extras(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """vLLM's chat response carries prompt_logprobs at its top level (one prompt)."""
        if self.body.prompt_logprobs is None or not finals:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(finals[0])}

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(list(c.token_ids[start:end]), list((c.logprobs or [])[start:end]),
                             self.body.top_logprobs or 0)

    def choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if self.tools is not None:
            content, calls = parse_tool_calls(self.tools, c.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message, "logprobs": self._logprobs(c, 0, len(c.token_ids)),
                "finish_reason": finish, "stop_reason": c.stop_reason}

    def opening_chunks(self) -> list[str]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.body.n)]

    def delta(self, out: RequestOutput, c: CompletionOutput, index: int) -> dict[str, Any]:
        end = len(c.token_ids)
        finish = c.finish_reason
        if self.tools is None:
            delta: dict[str, Any] = {"content": c.new_text} if c.new_text or finish is None else {}
        else:
            delta, finish = self._tool_delta(c, index)
        return {"index": c.index, "delta": delta, "logprobs": self._logprobs(c, end - len(c.new_token_ids), end),
                "finish_reason": finish}

    def _tool_delta(self, c: CompletionOutput, index: int) -> tuple[dict[str, Any], str | None]:
        """Content streams while it surely is content; a tool call is sent whole at the end."""
        assert self.tools is not None
        text, sent = c.text, self._streamed.get(index, 0)
        if c.finish_reason is None:
            upto = max(sent, streamable(self.tools, text))
            self._streamed[index] = upto
            return ({"content": text[sent:upto]} if upto > sent else {}), None
        content, calls = parse_tool_calls(self.tools, text)
        if not calls:
            return ({"content": text[sent:]} if len(text) > sent else {}), c.finish_reason
        cut = text.find(HERMES_OPEN)
        rest = text[sent:cut].rstrip() if content and cut > sent else ""
        delta: dict[str, Any] = {"content": rest} if rest else {}
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta, "tool_calls" if c.finish_reason == "stop" else c.finish_reason
