"""Racing a request's work against its client leaving (non-streaming answers: Starlette
cancels a streaming response on disconnect by itself, not a plain one)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T], gone: Callable[[], Exception]) -> T:
    """``work``'s result, unless the client leaves first: then ``work`` is cancelled (which
    aborts its requests or closes its upstream connections) and ``gone()`` is raised (the
    caller's 499). If this call itself is cancelled (shutdown), ``work`` goes down with it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise gone()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
