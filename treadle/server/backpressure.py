"""What one request may hold in the API process: a logprob budget checked before the
engine sees the request, and a bounded hand-off to a streaming client that stops reading.

Logprob budget. A request asks for up to

    entries = sum over prompts of  n x max_new_tokens x (logprobs + 1)        (sampled)
                                 + prompt_tokens x (prompt_logprobs + 1)       (prompt)

logprob entries (the chosen token plus the top ones), each a Python object of a few
hundred bytes in the engine's outputs and again in the response. Above
``ServerLimits.max_logprob_entries`` (``--max-logprob-entries``) the request is a 400
naming the limit; a request without logprobs holds none and is never refused here.

Back-pressure. The response writer pulls chunks only as fast as the socket drains; the
engine keeps stepping. Between them sits a queue of at most ``_QUEUE_OUTPUTS`` outputs:

    engine outputs --pump task--> [bounded queue] --> SSE writer --> socket (client)

When the queue stays full for ``stream_stall_timeout`` seconds (the client reads
nothing), the request is aborted in the engine (its KV blocks and outputs are freed) and
the stream ends with an error event, so a client that never reads holds at most the
queue, the socket's write buffer and its budget-bounded outputs, for a bounded time.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from treadle.sampling_params import SamplingParams
from treadle.server.errors import APIError
from treadle.server.state import ServerState

logger = logging.getLogger("treadle")

T = TypeVar("T")
_QUEUE_OUTPUTS = 8  # outputs (one engine step of one prompt each) waiting for a slow writer
_END = object()


def logprob_entries(params: SamplingParams, prompt_lens: list[int], max_model_len: int) -> int:
    """The most logprob entries ``params`` may produce over prompts of ``prompt_lens`` tokens."""
    total = 0
    for length in prompt_lens:
        if params.logprobs is not None:
            new = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - length)
            total += params.n * new * (params.logprobs + 1)
        if params.prompt_logprobs is not None:
            total += length * (params.prompt_logprobs + 1)
    return total


def check_logprob_budget(state: ServerState, params: SamplingParams, prompt_lens: list[int]) -> None:
    """A 400 naming --max-logprob-entries when the request could hold more entries than that."""
    cap = state.limits.max_logprob_entries
    entries = logprob_entries(params, prompt_lens, state.llm.max_model_len)
    if entries > cap:
        param = "logprobs" if params.logprobs is not None else "prompt_logprobs"
        raise APIError(400, f"this request asks for up to {entries} logprob entries (prompts x n x max_tokens x "
                            f"(logprobs + 1), plus prompt tokens x (prompt_logprobs + 1)); this server takes at most "
                            f"{cap} per request (--max-logprob-entries): lower n, max_tokens or logprobs",
                       param, "too_many_logprobs")


async def bounded_outputs(outputs: AsyncIterator[T], stall_timeout: float,
                          abort: Callable[[], None]) -> AsyncIterator[T]:
    """``outputs`` through a queue of at most ``_QUEUE_OUTPUTS``; a reader that takes none
    for ``stall_timeout`` seconds gets the request aborted (``abort``) and then an APIError."""
    queue: asyncio.Queue[object] = asyncio.Queue(_QUEUE_OUTPUTS)
    stalled: list[APIError] = []

    async def pump() -> None:
        try:
            async for out in outputs:
                try:
                    await asyncio.wait_for(queue.put(out), stall_timeout)
                except TimeoutError:
                    logger.warning("a streaming client read nothing for %.0f s: its request is aborted "
                                   "(--stream-stall-timeout)", stall_timeout)
                    stalled.append(APIError(408, f"the client read nothing for {stall_timeout:g} s; the request "
                                                 "was aborted (--stream-stall-timeout)", None, "client_too_slow"))
                    abort()
                    return
            await queue.put(_END)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which reports it in-band
            await queue.put(e)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            if stalled:
                raise stalled[0]
            item = await _next(queue, task)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:  # a generator the pump left suspended: run its cleanup now
            await aclose()


async def _next(queue: asyncio.Queue[object], pump: asyncio.Task[None]) -> object:
    """The next queued item; _END once the pump has stopped and nothing is left."""
    getter = asyncio.ensure_future(queue.get())
    await asyncio.wait([getter, pump], return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return queue.get_nowait() if not queue.empty() else _END
