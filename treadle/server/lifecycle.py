"""Running the app under uvicorn with a graceful drain on SIGTERM / SIGINT.

uvicorn's own handling closes the listening socket at once (new clients get
"connection refused", not a 503) and re-raises the signal at exit (exit code
-15). Here the first signal only starts a drain: the app answers 503 to new
work while in-flight requests finish, for up to ``shutdown_timeout`` seconds;
then every request still open ends at once with an OpenAI error (a stream gets an
error event and ``data: [DONE]``, a non-streaming request a 503 body), one log line
says how many, uvicorn shuts down and ``serve`` returns normally (exit code 0). A
second signal skips the wait and aborts the same way.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from treadle.server.errors import APIError
from treadle.server.state import ServerState

logger = logging.getLogger("treadle")

_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float,
                 on_ready: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._skip_wait = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes; hop onto the loop to act.
        if self._loop is None:
            self.should_exit = self.force_exit = True
            return
        if self.state.draining:  # a second signal: stop waiting for in-flight requests
            self._loop.call_soon_threadsafe(self._abort_now)
            return
        self.request_drain()

    def request_drain(self) -> None:
        """Start draining, from any thread (or a signal handler)."""
        self.state.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Stop admitting and exit once in-flight requests are done (or time is up)."""
        self.state.draining = True
        if self.state.grammar_probe is not None:  # a compile in progress must not hold the exit
            self.state.grammar_probe.close()
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    def _abort_now(self) -> None:
        self._skip_wait = True
        self.begin_drain()

    async def _drain(self) -> None:
        llm = self.state.llm
        deadline = time.monotonic() + self.shutdown_timeout
        logger.info("draining: %d request(s) in flight, waiting up to %.0f s", llm.num_open_requests,
                    self.shutdown_timeout)
        while llm.num_open_requests > 0 and time.monotonic() < deadline and not self._skip_wait:
            await asyncio.sleep(_POLL_S)
        if self.state.open_groups:
            error = APIError.unavailable("the server shut down before this request finished", "shutting_down")
            aborted = self.state.abort_open(error)
            logger.warning("shutdown: aborted %d unfinished request(s) with a 503 error", aborted)
            await asyncio.sleep(_POLL_S)  # let each response write its error and [DONE]
        self.should_exit = True
