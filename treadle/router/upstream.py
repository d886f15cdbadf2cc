"""What one upstream call is made of: the job a client sent, the errors that send it to another
instance (``UpstreamFailure``) or back to the client as they are (``Relay``), and an open stream
whose first event has arrived. ``forward.py`` makes the calls."""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response

from treadle.router.instances import Instance, describe
from treadle.router.policy import estimate_prompt_tokens, prompt_text


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Relay(Exception):
    """An answer that goes to the client as it is: an instance's 4xx, or the router's own error."""

    def __init__(self, status: int, content: bytes, media_type: str = "application/json") -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.content, self.media_type = status, content, media_type

    @staticmethod
    def error(status: int, message: str, type_: str, code: str) -> Relay:
        return Relay(status, json.dumps(error_body(message, type_, code)).encode())

    @staticmethod
    def of(resp: httpx.Response) -> Relay:
        return Relay(resp.status_code, resp.content, resp.headers.get("content-type", "application/json"))

    def response(self) -> Response:
        return Response(self.content, self.status, media_type=self.media_type)


class UpstreamFailure(Exception):
    """The instance failed before the client saw anything: try another one."""

    def __init__(self, message: str, down: bool) -> None:
        super().__init__(message)
        self.down = down  # unreachable: out of rotation until a health check passes


@contextlib.contextmanager
def upstream_errors() -> Iterator[None]:
    """httpx's failures of one upstream call as UpstreamFailures (``down``: the instance could
    not be reached; a read timeout is not that)."""
    try:
        yield
    except httpx.ConnectTimeout as e:
        raise UpstreamFailure(describe(e), down=True) from None
    except httpx.TimeoutException as e:
        raise UpstreamFailure(f"timed out ({type(e).__name__})", down=False) from None
    except httpx.HTTPError as e:
        raise UpstreamFailure(describe(e), down=True) from None


@dataclass
class Job:
    """One client request as the forwarder sees it."""
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    headers: dict[str, str]  # passed on to instances (authorization)

    @property
    def text(self) -> str:
        return prompt_text(self.body)

    @property
    def prompt_tokens(self) -> int:
        return estimate_prompt_tokens(self.body)


@dataclass
class OpenStream:
    """An upstream stream whose first event has arrived."""
    instance: Instance
    response: httpx.Response
    lines: AsyncIterator[str]
    first: str  # the first "data: ..." line
    prompt_tokens: int  # what the instance's in-flight count was raised by
    closed: bool = False
    on_close: Callable[[], None] | None = None  # gives the dispatch queue's slot back

    async def close(self) -> None:
        """Idempotent: closing the upstream connection makes the instance abort the request."""
        if not self.closed:
            self.closed = True
            self.instance.end(self.prompt_tokens)
            if self.on_close is not None:
                self.on_close()
            await self.response.aclose()


async def first_event(lines: AsyncIterator[str]) -> str | None:
    async for line in lines:
        if line.startswith("data:"):
            return line
    return None
