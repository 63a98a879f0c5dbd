"""Connection timeouts for the uvicorn servers here: idle and half-sent connections are closed.

uvicorn closes a connection idle between two requests after ``timeout_keep_alive``, but its h11 protocol
sets no time limit on a connection that sends no request, stops halfway through its headers, or never
finishes its body: each keeps a socket (and, with its headers sent, a request task) open for good.
:class:`TimedH11Protocol` gives every request a deadline: the whole request must arrive within
``request`` seconds of the connection opening, or of its first byte on a kept-alive connection; otherwise
the connection is closed. Pass :func:`uvicorn_options` to ``uvicorn.run`` or ``uvicorn.Config``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionTimeouts:
    """How long a server waits for a client.

    Args:
        request: seconds to receive a whole request (headers and body), counted from the connection opening
            or, on a kept-alive connection, from the request's first byte; then the connection is closed.
        keep_alive: seconds a connection may stay idle between two requests (uvicorn's
            ``timeout_keep_alive``).
    """

    request: float = 30.0
    keep_alive: float = 5.0

    def __post_init__(self) -> None:
        if self.request <= 0 or self.keep_alive <= 0:
            raise ValueError(
                f"connection timeouts must be positive (request={self.request}, keep_alive={self.keep_alive})"
            )


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for receiving each request (``request_timeout`` seconds)."""

    def __init__(self, *args: Any, request_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.request_timeout = request_timeout
        self._request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request is (still) on its way
            self._arm()
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY) or self.transport.is_closing():
            self._disarm()  # the request is whole (or the connection is done with)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._request_timer is None:
            self._request_timer = self.loop.call_later(self.request_timeout, self._on_request_timeout)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _on_request_timeout(self) -> None:
        self._request_timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]} " if self.client else ""
            logger.info("%sclosed: no whole request within %gs", client, self.request_timeout)
            self.transport.close()  # a request task waiting for the body sees a disconnect


DEFAULT_TIMEOUTS = ConnectionTimeouts()


def uvicorn_options(timeouts: ConnectionTimeouts) -> dict[str, Any]:
    """``uvicorn.run`` / ``uvicorn.Config`` keyword arguments that apply ``timeouts`` (h11 protocol)."""
    return {
        "http": functools.partial(TimedH11Protocol, request_timeout=timeouts.request),
        "timeout_keep_alive": timeouts.keep_alive,
    }
