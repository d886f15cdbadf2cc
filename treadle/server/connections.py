"""Connection hygiene under uvicorn: a header-read timeout and a cap on idle connections
per client address, as an h11 protocol subclass (uvicorn arms no timer until a first
response completes, so a socket that sends half a request line, or nothing, was held
for ever; its keep-alive timer is cancelled by any byte, so a slow header trickle was too).

    connection made ----------------------- arm header timer (header_timeout)
    first byte of a request (idle before) - arm header timer, if not armed
    request headers complete -------------- disarm (the app now owns the request)
    response complete --------------------- uvicorn's keep-alive timer; idle again
    header timer fires -------------------- close the connection

Idle means: no request in progress (before its headers complete, or between requests)
for at least ``IDLE_GRACE_S`` (so a burst of new connections whose headers are on their way
is not idle). When a connection opens while its address already holds
``max_idle_per_client`` idle connections, the oldest idle one is closed (a kept-alive client reconnects; a client that
opens sockets and sends nothing loses them). Both are plain state on each protocol object
and uvicorn's own set of connections: no module-level state.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("treadle")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_IDLE_PER_CLIENT = 64
IDLE_GRACE_S = 1.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and a per-address idle cap; the
    limits are class attributes of the subclass ``guarded_protocol`` makes."""

    header_timeout: ClassVar[float] = DEFAULT_HEADER_TIMEOUT_S
    max_idle_per_client: ClassVar[int] = DEFAULT_MAX_IDLE_PER_CLIENT

    _header_timer: asyncio.TimerHandle | None = None
    idle_since: float = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self._arm()
        self._close_excess_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.is_idle():
            self._arm()  # a new request begins: its headers must be complete in time
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self.is_idle():
            self._disarm()

    def on_response_complete(self) -> None:
        self.idle_since = time.monotonic()
        super().on_response_complete()

    def is_idle(self) -> bool:
        """No request whose headers have arrived is in progress on this connection."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.is_idle() and not self.transport.is_closing():
            logger.debug("closing %s: no complete request headers within %.0f s", self.client, self.header_timeout)
            self.transport.close()

    def _close_excess_idle(self) -> None:
        host = self.client[0] if self.client else None
        settled = time.monotonic() - IDLE_GRACE_S
        idle = sorted((c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.is_idle()
                       and c.idle_since <= settled and (c.client[0] if c.client else None) == host
                       and not c.transport.is_closing()), key=lambda c: c.idle_since)
        for conn in idle[: max(0, len(idle) + 1 - self.max_idle_per_client)]:
            logger.debug("closing an idle connection of %s: more than %d idle", host, self.max_idle_per_client)
            conn.transport.close()


def guarded_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                     max_idle_per_client: int = DEFAULT_MAX_IDLE_PER_CLIENT) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol class with these limits (uvicorn builds one object per connection)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_idle_per_client": max_idle_per_client})


def uvicorn_config(app: Any, header_timeout: float | None = None, max_idle_per_client: int | None = None,
                   **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for ``app`` with the guarded protocol (None: the defaults)."""
    protocol = guarded_protocol(DEFAULT_HEADER_TIMEOUT_S if header_timeout is None else header_timeout,
                                max_idle_per_client or DEFAULT_MAX_IDLE_PER_CLIENT)
    return uvicorn.Config(app, http=protocol, **kwargs)
