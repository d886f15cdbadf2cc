"""Per-app server state, and the request lifecycle both generation endpoints share:
admission checks, turning body fields into SamplingParams, submitting prompts,
collecting or streaming outputs, recording metrics, and aborting on disconnect."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from treadle.config import EngineDeadError, TreadleError
from treadle.engine.engine_client import EngineClient, OutputGroup
from treadle.engine.llm_engine import PromptType
from treadle.engine.outputs import RequestOutput
from treadle.sampling_params import SamplingParams
from treadle.server.errors import APIError, engine_error
from treadle.server.metrics import ServerMetrics
from treadle.server.protocol import MAX_N, _SamplingFields

T = TypeVar("T")


@dataclass
class ServerState:
    llm: EngineClient
    served_model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    max_waiting: int | None = None
    draining: bool = False

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{self.served_model_name}`", "model", "model_not_found")

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError.unavailable("the server is shutting down", "shutting_down")
        if not self.llm.is_alive():
            raise APIError.unavailable(f"the engine is not running ({self.llm.dead_error})", "engine_dead")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    if not 1 <= body.n <= MAX_N:
        raise APIError.bad_request(f"n must be in [1, {MAX_N}]", "n")
    if body.logit_bias:
        raise APIError.bad_request("logit_bias is not supported", "logit_bias")
    try:
        return SamplingParams(
            n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop,
            max_tokens=max_tokens, ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
    except TreadleError as e:
        raise engine_error(e) from None


async def submit(state: ServerState, base_id: str, prompts: list[PromptType], params: SamplingParams) -> OutputGroup:
    """Admit every prompt (ids ``base_id-i``) or none: on any refusal the admitted ones
    are aborted and the refusal becomes an APIError."""
    state.check_admitting()
    group = state.llm.group()
    try:
        for i, prompt in enumerate(prompts):
            await group.add(f"{base_id}-{i}", prompt, params, max_waiting=state.max_waiting)
    except TreadleError as e:
        group.close()
        raise engine_error(e) from None
    except BaseException:
        group.close()
        raise
    return group


def prompt_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


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


async def collect(state: ServerState, group: OutputGroup, num_prompts: int) -> list[RequestOutput]:
    """The final output of every prompt, in prompt order."""
    finals: list[RequestOutput | None] = [None] * num_prompts
    try:
        async for out in stream_outputs(state, group):
            if out.finished:
                finals[prompt_index(out.request_id)] = out
    except EngineDeadError as e:
        raise APIError(500, f"the request failed: {e}", None, "engine_error") from None
    return [f for f in finals if f is not None]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client goes away first; then cancel it (which aborts its
    requests) and raise CancelledError. Used by non-streaming responses, which Starlette
    does not cancel on disconnect by itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (e.g. shutdown): take the work down too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client closed the connection", None, "client_disconnected")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    err = e if isinstance(e, APIError) else APIError(500, f"the request failed: {e}", None, "engine_error")
    return sse(err.body())


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def now() -> int:
    return int(time.time())
