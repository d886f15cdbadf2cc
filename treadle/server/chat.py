"""POST /v1/chat/completions: messages through the model's chat template, n choices,
streamed as server-sent events or returned whole; OpenAI's chat logprobs shape."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from treadle.config import TreadleError
from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.server.errors import APIError
from treadle.server.protocol import ChatCompletionRequest, ChatMessage
from treadle.server.state import (
    SSE_DONE,
    ServerState,
    collect,
    new_id,
    now,
    release,
    sampling_params,
    sse,
    sse_error,
    stream_outputs,
    submit,
    until_disconnect,
    usage,
)
from treadle.tokenizer import Tokenizer

router = APIRouter()


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> dict[str, Any]:
    """Render the chat template; the result already holds any BOS the template writes."""
    if not messages:
        raise APIError.bad_request("messages must not be empty", "messages")
    try:
        text = tokenizer.apply_chat_template([m.as_template_input() for m in messages], add_generation_prompt)
    except TreadleError as e:
        raise APIError.bad_request(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template tripping over user content is the user's 400
        raise APIError.bad_request(f"chat template failed on these messages: {e}", "messages") from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.treadle
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError.bad_request("top_logprobs must be in [0, 20]", "top_logprobs")
    prompt = chat_prompt(state.llm.tokenizer, body.messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    rid = new_id("chatcmpl")
    group = await submit(state, rid, [prompt], params)
    view = _ChatView(state, body, rid)
    if body.stream:
        return StreamingResponse(view.stream(stream_outputs(state, group)), media_type="text/event-stream",
                                 background=BackgroundTask(release, state, group))
    finals = await until_disconnect(request, collect(state, group, 1))
    choices = [view.choice(c) for out in finals for c in out.outputs]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": view.created,
                         "model": state.served_model_name, "choices": choices, "usage": usage(finals)})


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


class _ChatView:
    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str) -> None:
        self.state, self.body, self.request_id = state, body, request_id
        self.created = now()

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(list(c.token_ids[start:end]), list((c.logprobs or [])[start:end]),
                             self.body.top_logprobs or 0)

    def choice(self, c: CompletionOutput) -> dict[str, Any]:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, 0, len(c.token_ids)), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.state.served_model_name, "choices": choices}
        if usage_ is not None:
            data["usage"] = usage_
        return sse(data)

    def _delta(self, c: CompletionOutput) -> dict[str, Any]:
        end = len(c.token_ids)
        delta = {"content": c.new_text} if c.new_text or c.finish_reason is None else {}
        return {"index": c.index, "delta": delta, "logprobs": self._logprobs(c, end - len(c.new_token_ids), end),
                "finish_reason": c.finish_reason}

    async def stream(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []
        done: set[int] = set()
        try:
            for i in range(self.body.n):
                yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}])
            async for out in outputs:
                for c in out.outputs:
                    if c.index in done or not (c.new_token_ids or c.new_text or c.finish_reason):
                        continue
                    if c.finish_reason is not None:
                        done.add(c.index)
                    yield self.chunk([self._delta(c)])
                if out.finished:
                    finals.append(out)
            if self.body.include_usage:
                yield self.chunk([], usage(finals))
        except Exception as e:  # noqa: BLE001 - report in-band: the status line is already sent
            yield sse_error(e)
        yield SSE_DONE
