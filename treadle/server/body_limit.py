"""A request-body size limit as pure ASGI middleware: a body over ``max_bytes`` is a 413
with an OpenAI error body, decided from Content-Length before reading, or while reading
a chunked body, so no handler ever buffers or parses more than the limit."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.server.errors import APIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, int(declared))
            return
        body: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, size)
                return
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(body), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        error = APIError(413, f"the request body ({size} bytes or more) is larger than this server's limit "
                              f"({self.max_bytes} bytes; see --max-request-bytes)", None, "request_too_large",
                         {"Connection": "close"})  # stop reading the rest of the body
        await error.response()(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first hands out ``messages``, then waits on the real one (so the app
    still hears of a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
