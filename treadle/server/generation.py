"""The request lifecycle both generation endpoints share, as one base class.

    body --check--> SamplingParams, size caps --prompts (worker thread: template, tokenize)-->
    submit (all prompts or none) --stream?--> SSE chunks ... [DONE]
                                  \\--------> collect finals --> one JSON response

``GenerationView`` owns that skeleton; /v1/completions and /v1/chat/completions
subclass it with their body checks, prompts, and choice/delta shapes. Leaving early
(disconnect, cancellation, drain) aborts what is left of the request in the engine.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.responses import Response

from treadle.asgi.disconnect import until_disconnect
from treadle.config import EngineDeadError, InvalidRequestError, StepFailedError, TreadleError
from treadle.engine.client.engine_client import OutputGroup
from treadle.engine.inputs import PromptType
from treadle.engine.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.server.backpressure import bounded_outputs, check_logprob_budget
from treadle.server.errors import APIError, engine_error
from treadle.server.protocol import MAX_N, SamplingFields
from treadle.server.sse import SSE_DONE, sse, sse_error
from treadle.server.state import ServerState
from treadle.server.structured import StructuredRequest, check_compile_budget, structured_request


class GenerationView(ABC):
    """One generation request, from body to response. Subclasses give the endpoint's
    names and shapes; ``respond`` is the shared skeleton."""

    id_prefix: ClassVar[str]
    object_name: ClassVar[str]  # the whole response's "object"
    chunk_object: ClassVar[str]  # a streamed chunk's "object"
    prompt_param: ClassVar[str]  # the body field engine prompt errors point at

    def __init__(self, state: ServerState, body: SamplingFields) -> None:
        self.state, self.body = state, body
        self.request_id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.structured: StructuredRequest | None = None  # set by make_params
        self.prompt_lens: list[int] = []  # tokens per prompt, set once the prompts are ready
        self._generated: dict[int, int] = {}  # tokens generated so far, per choice (streamed usage)

    # -- what subclasses give ----------------------------------------------------------
    @abstractmethod
    def sampling_params(self) -> SamplingParams:
        """Endpoint-specific 400s, then the body's SamplingParams (via ``make_params``)."""

    @abstractmethod
    def num_prompts(self) -> int:
        """How many prompts the body holds (known before tokenizing; at least 1)."""

    @abstractmethod
    def prompts(self) -> list[PromptType]:
        """The engine prompts. Runs in a worker thread (templates and tokenizing may be
        slow), so it must not touch the event loop; raise APIError for bad input."""

    @abstractmethod
    def choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        """One choice of the non-streaming response."""

    @abstractmethod
    def delta(self, out: RequestOutput, c: CompletionOutput, index: int) -> dict[str, Any]:
        """One choice of a streamed chunk: what ``c`` added this step."""

    def choice_index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return c.index

    def opening_chunks(self) -> list[str]:
        """Chunks sent before any output (chat: the assistant role)."""
        return []

    def first_output_chunks(self, out: RequestOutput) -> list[str]:
        """Chunks sent when a prompt's first output arrives (completions: echo)."""
        return []

    def structured_request(self) -> StructuredRequest | None:
        """What the output must match (chat adds tool calls); None: free text."""
        return structured_request(self.body)

    def response_extras(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """Top-level fields of the whole (non-streamed) response beyond the common ones."""
        return {}

    def completion_tokens(self, c: CompletionOutput) -> int:
        """Tokens ``c`` counts in usage (completions' echo-only requests count none)."""
        return len(c.token_ids)

    def usage(self, finals: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(self.completion_tokens(c) for o in finals for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- the skeleton ----------------------------------------------------------------------
    async def respond(self, request: Request) -> Response:
        state = self.state
        state.check_model(self.body.model)
        params = self.sampling_params()
        state.check_num_sequences(self.num_prompts(), params.n)
        state.check_admitting()
        if self.structured is None:
            prompts = await asyncio.to_thread(self._prepare)
        else:  # its compile probe may take seconds: a client that leaves stops it
            left = threading.Event()
            try:
                prompts = await until_disconnect(request, asyncio.to_thread(self._prepare, left), _client_gone)
            finally:
                left.set()
        self.prompt_lens = [prompt_length(p) for p in prompts]
        check_logprob_budget(state, params, self.prompt_lens)
        group = await submit(state, self.request_id, prompts, params, self.prompt_param, self.body.priority)
        if self.body.stream:
            outputs = bounded_outputs(stream_outputs(state, group), state.limits.stream_stall_timeout,
                                      lambda: release(state, group))
            return StreamingResponse(self._sse(outputs), media_type="text/event-stream",
                                     background=BackgroundTask(release, state, group))
        finals = await until_disconnect(request, collect(state, group, len(prompts)), _client_gone)
        choices = [self.choice(out, c) for out in finals for c in out.outputs]
        data = {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": state.served_model_name, "choices": choices, "usage": self.usage(finals)}
        data.update(self.response_extras(finals))
        kv_params = [out.kv_transfer_params for out in finals if out.kv_transfer_params is not None]
        if kv_params:  # a P/D producer's answer (one prompt, n == 1): where the consumer pulls the KV
            data["kv_transfer_params"] = kv_params[0]
        return JSONResponse(data)

    def _prepare(self, left: threading.Event | None = None) -> list[PromptType]:
        """In a worker thread: the prompts, and the grammar compiled into the engine's cache
        (so a bad schema is a 400 here and the step loop never compiles). ``left``: set when
        the client has gone."""
        prompts = self.prompts()
        if self.structured is not None:
            check_compile_budget(self.state, self.structured, left)
            try:
                self.state.llm.compile_grammar(self.structured.spec)
            except TreadleError as e:
                raise APIError.bad_request(str(e), self.structured.param) from None
        return prompts

    def make_params(self, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
        body = self.body
        if body.prompt_logprobs is not None:
            if body.stream:
                raise APIError.bad_request("prompt_logprobs cannot be streamed; send it with stream false",
                                           "prompt_logprobs")
            prompt_logprobs = body.prompt_logprobs
        if not 1 <= body.n <= MAX_N:
            raise APIError.bad_request(f"n must be in [1, {MAX_N}]", "n")
        if body.logit_bias:
            raise APIError.bad_request("logit_bias is not supported", "logit_bias")
        if body.kv_transfer_params is not None and self.state.llm.snapshot.kv_transfer is None:
            raise APIError.bad_request("kv_transfer_params needs a server started with --kv-transfer-config",
                                       "kv_transfer_params")
        self.structured = self.structured_request()
        if self.structured is not None and self.state.llm.tokenizer is None:
            raise APIError.bad_request("structured output needs a tokenizer, and this server was started with "
                                       "--skip-tokenizer-init", self.structured.param)
        try:
            return SamplingParams(
                n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop, max_tokens=max_tokens,
                ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                min_tokens=body.min_tokens, stop_token_ids=list(body.stop_token_ids or []),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                structured_outputs=self.structured.spec if self.structured is not None else None,
                kv_transfer_params=body.kv_transfer_params,
            )
        except TreadleError as e:
            raise engine_error(e) from None

    def tokenized(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        """``text`` as an engine prompt with its token ids; a text that cannot fit is a 400
        before any tokenizing (a cheap character-count bound)."""
        max_len = self.state.llm.max_model_len
        if len(text) > self.state.max_prompt_chars:
            raise APIError(400, f"the prompt has {len(text)} characters, more than this model's context "
                                f"({max_len} tokens) can hold", self.prompt_param, "context_length_exceeded")
        ids = self.state.tokenizer(self.prompt_param).encode(text, add_special_tokens=add_special_tokens)
        if len(ids) > max_len:  # refused here, in the worker thread: the engine never sees the list
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than max_model_len ({max_len})",
                           self.prompt_param, "context_length_exceeded")
        return {"prompt": text, "prompt_token_ids": ids}

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        """One SSE chunk; with stream_options.continuous_usage_stats every chunk carries the
        usage so far (all prompts' tokens, the tokens generated up to this chunk)."""
        data: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                                "model": self.state.served_model_name, "choices": choices}
        if usage_ is None and self.body.continuous_usage:
            usage_ = self._usage_so_far()
        if usage_ is not None:
            data["usage"] = usage_
        return sse(data)

    def _usage_so_far(self) -> dict[str, int]:
        prompt, completion = sum(self.prompt_lens), sum(self._generated.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _sse(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        try:
            async for chunk in self._chunks(outputs):
                yield chunk
        except Exception as e:  # noqa: BLE001 - report in-band: the status line is already sent
            yield sse_error(e)
        yield SSE_DONE

    async def _chunks(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """SSE text, one piece per engine output: the events of all its choices in one
        write (n choices were n writes back to back, and after a client had gone each
        failed one logged asyncio's "socket.send() raised exception")."""
        finals: list[RequestOutput] = []
        done: set[int] = set()
        seen: set[str] = set()
        opening = "".join(self.opening_chunks())
        if opening:
            yield opening
        async for out in outputs:
            events: list[str] = []
            if out.request_id not in seen:
                seen.add(out.request_id)
                events.extend(self.first_output_chunks(out))
            for c in out.outputs:
                index = self.choice_index(out, c)
                if index in done or not (c.new_token_ids or c.new_text or c.finish_reason):
                    continue
                if c.finish_reason is not None:
                    done.add(index)
                self._generated[index] = self.completion_tokens(c)
                choice = self.delta(out, c, index)
                if choice.get("delta") == {} and choice.get("logprobs") is None and choice["finish_reason"] is None:
                    continue  # nothing to say yet (a tool call still being written): no empty chunk
                events.append(self.chunk([choice]))
            if events:
                yield "".join(events)
            if out.finished:
                finals.append(out)
        if self.body.include_usage:
            yield self.chunk([], self.usage(finals))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prompt_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


async def submit(state: ServerState, base_id: str, prompts: list[PromptType], params: SamplingParams,
                 prompt_param: str = "prompt", priority: int = 0) -> OutputGroup:
    """Admit every prompt (ids ``base_id-i``) or none: all adds go to the engine at once;
    on any refusal the admitted ones are aborted and the refusal becomes an APIError."""
    state.check_admitting()
    group = state.llm.group()
    limit = state.limits.max_waiting
    adds = [group.add(f"{base_id}-{i}", prompt, params, priority,
                      max_waiting=None if limit is None else limit + i * params.n)  # earlier prompts of ours
            for i, prompt in enumerate(prompts)]
    try:
        results = await asyncio.gather(*adds, return_exceptions=True)
    except BaseException:
        group.close()
        raise
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        group.close()
        if isinstance(error, TreadleError):
            raise _admission_error(error, prompt_param) from None
        raise error
    state.open_groups.add(group)
    return group


def _admission_error(e: TreadleError, prompt_param: str) -> APIError:
    err = engine_error(e)
    if isinstance(e, InvalidRequestError) and e.param == "prompt":
        err.param = prompt_param
    return err


async def stream_outputs(state: ServerState, group: OutputGroup) -> AsyncIterator[RequestOutput]:
    """Outputs as they come, metrics recorded as requests finish; leaving early
    (disconnect, cancellation) aborts what is left."""
    try:
        async for out in group:
            if out.finished:
                state.metrics.observe_finished(out)
            yield out
    finally:
        release(state, group)


def release(state: ServerState, group: OutputGroup) -> None:
    """Abort whatever of ``group`` has not finished and count it; idempotent. Also run as
    the streaming response's background task, which Starlette runs even after a disconnect."""
    state.metrics.observe_aborted(len(group.unfinished))
    group.close()
    state.open_groups.discard(group)


async def collect(state: ServerState, group: OutputGroup, num_prompts: int) -> list[RequestOutput]:
    """The final output of every prompt, in prompt order."""
    finals: list[RequestOutput | None] = [None] * num_prompts
    try:
        async for out in stream_outputs(state, group):
            if out.finished:
                finals[prompt_index(out.request_id)] = out
    except (EngineDeadError, StepFailedError) as e:
        raise APIError(500, f"the request failed: {e}", None, "engine_error") from None
    return [f for f in finals if f is not None]


def _client_gone() -> APIError:
    return APIError(499, "client closed the connection", None, "client_disconnected")


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or
    {token_id: {logprob, rank, decoded_token}}."""
    entries = list(out.prompt_logprobs or [])[: len(out.prompt_token_ids)]
    entries += [None] * (len(out.prompt_token_ids) - len(entries))
    return [None if e is None else {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in e.items()}
            for e in entries]


def prompt_length(prompt: PromptType) -> int:
    """Tokens of a prepared prompt (token ids, or a dict holding them)."""
    if isinstance(prompt, dict):
        return len(prompt.get("prompt_token_ids") or [])
    return len(prompt) if isinstance(prompt, list) else 0
