"""POST /v1/completions: one or many prompts (text or token ids), n choices each,
streamed as server-sent events or returned whole; legacy logprobs and echo."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from treadle.engine.outputs import CompletionOutput, Logprob, RequestOutput
from treadle.server.errors import APIError
from treadle.server.protocol import CompletionRequest
from treadle.server.state import (
    SSE_DONE,
    ServerState,
    collect,
    new_id,
    now,
    prompt_index,
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


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.treadle
    state.check_model(body.model)
    if body.suffix:
        raise APIError.bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError.bad_request("best_of must equal n (or be left out)", "best_of")
    prompts = body.prompts()
    if not prompts:
        raise APIError.bad_request("prompt must not be empty", "prompt")
    echo_logprobs = body.logprobs if body.echo else None
    params = sampling_params(body, body.max_tokens, body.logprobs, echo_logprobs)
    rid = new_id("cmpl")
    group = await submit(state, rid, list(prompts), params)
    view = _View(state, body, rid)
    if body.stream:
        return StreamingResponse(view.stream(stream_outputs(state, group)), media_type="text/event-stream",
                                 background=BackgroundTask(release, state, group))
    finals = await until_disconnect(request, collect(state, group, len(prompts)))
    choices = [view.choice(out, c) for out in finals for c in out.outputs]
    return JSONResponse({"id": rid, "object": "text_completion", "created": view.created,
                         "model": state.served_model_name, "choices": choices, "usage": usage(finals)})


def legacy_logprobs(tokenizer: Tokenizer, ids: list[int], entries: list[dict[int, Logprob] | None],
                    text_offset: int) -> dict[str, list[Any]]:
    """OpenAI's completions shape: tokens, token_logprobs, top_logprobs, text_offset.
    An entry of None (the first prompt token) has no logprob."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, entry in zip(ids, entries):
        chosen = entry.get(tid) if entry else None
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else \
            tokenizer.decode([tid], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen else None)
        top: dict[str, float] = {}
        for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0) if entry else []:
            top.setdefault(lp.decoded_token or "", lp.logprob)  # texts can repeat (byte tokens): keep the likeliest
        tops.append(top if entry else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


class _View:
    """Builds the response objects of one completions request."""

    def __init__(self, state: ServerState, body: CompletionRequest, request_id: str) -> None:
        self.state, self.body, self.request_id = state, body, request_id
        self.tokenizer = state.llm.tokenizer
        self.created = now()

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return prompt_index(out.request_id) * self.body.n + c.index

    def choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        prefix = self.prompt_text(out) if self.body.echo else ""
        logprobs = None
        if self.body.logprobs is not None:
            ids = list(c.token_ids)
            entries: list[dict[int, Logprob] | None] = list((c.logprobs or [])[: len(c.token_ids)])
            if self.body.echo:
                ids, entries = list(out.prompt_token_ids) + ids, self._prompt_entries(out) + entries
            logprobs = legacy_logprobs(self.tokenizer, ids, entries, 0)
        return {"index": self.index(out, c), "text": prefix + c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {"id": self.request_id, "object": "text_completion", "created": self.created,
                                "model": self.state.served_model_name, "choices": choices}
        if usage_ is not None:
            data["usage"] = usage_
        return sse(data)

    @staticmethod
    def _prompt_entries(out: RequestOutput) -> list[dict[int, Logprob] | None]:
        """One entry per prompt token (the first has none)."""
        entries = list(out.prompt_logprobs or [])[: len(out.prompt_token_ids)]
        return entries + [None] * (len(out.prompt_token_ids) - len(entries))

    def _echo_chunks(self, out: RequestOutput) -> list[str]:
        text = self.prompt_text(out)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = legacy_logprobs(self.tokenizer, list(out.prompt_token_ids), self._prompt_entries(out), 0)
        return [self.chunk([{"index": self.index(out, c), "text": text, "logprobs": logprobs,
                             "finish_reason": None}]) for c in out.outputs]

    def _delta(self, c: CompletionOutput, offsets: dict[int, int], index: int) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None:
            end = len(c.token_ids)
            start = end - len(c.new_token_ids)
            entries: list[dict[int, Logprob] | None] = list((c.logprobs or [])[start:end])
            logprobs = legacy_logprobs(self.tokenizer, list(c.new_token_ids), entries, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(c.new_text)
        return {"index": index, "text": c.new_text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    async def stream(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []
        done: set[int] = set()
        echoed: set[str] = set()
        offsets: dict[int, int] = {}
        try:
            async for out in outputs:
                if self.body.echo and out.request_id not in echoed:
                    echoed.add(out.request_id)
                    for chunk in self._echo_chunks(out):
                        yield chunk
                for c in out.outputs:
                    index = self.index(out, c)
                    if index in done or not (c.new_token_ids or c.new_text or c.finish_reason):
                        continue
                    if c.finish_reason is not None:
                        done.add(index)
                    yield self.chunk([self._delta(c, offsets, index)])
                if out.finished:
                    finals.append(out)
            if self.body.include_usage:
                yield self.chunk([], usage(finals))
        except Exception as e:  # noqa: BLE001 - report in-band: the status line is already sent
            yield sse_error(e)
        yield SSE_DONE
