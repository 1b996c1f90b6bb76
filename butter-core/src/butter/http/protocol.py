"""uvicorn's h11 protocol with deadlines and a connection cap, and a throttle for log floods.

uvicorn times out only an idle keep-alive connection after a response. A client that
opens a socket and sends nothing, or trickles a request head a byte at a time
(slowloris), or stops half-way through a body, holds its socket forever; enough of
them exhaust the open-files limit and the server stops accepting anyone. Here:

- the request head must be complete within ``header_timeout`` of the connection (or,
  on a kept-alive connection, of its first byte); bytes trickling in do not extend it.
  A partial head is answered 408, a connection that sent nothing is closed;
- the body must be complete within ``body_timeout`` of the head, or the connection is
  closed (the handler's ``receive`` then reports a disconnect);
- beyond ``max_connections`` open connections, a new one is answered 503 and closed at
  once, without reading from it. uvicorn's ``limit_concurrency`` cannot do this: it is
  consulted only when a request head has arrived, so idle sockets are never refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import attrs
import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger("butter.http")

HEADER_TIMEOUT = 10.0
BODY_TIMEOUT = 30.0
KEEP_ALIVE = 5.0
MAX_CONNECTIONS = 512
MAX_HEAD_BYTES = 64 * 1024
REFUSED_MESSAGE = "Refused a connection: too many open connections"


@attrs.frozen
class SocketLimits:
    """Deadlines and caps for the server's connections (seconds, connections, bytes)."""

    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    keep_alive: float = KEEP_ALIVE
    max_connections: int = MAX_CONNECTIONS
    max_head_bytes: int = MAX_HEAD_BYTES


def _canned(status: str, text: str, *extra: str) -> bytes:
    body = text.encode()
    head = [f"HTTP/1.1 {status}", "content-type: text/plain; charset=utf-8",
            f"content-length: {len(body)}", "connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


REQUEST_TIMEOUT = _canned("408 Request Timeout", "request head not received in time\n")
SERVICE_UNAVAILABLE = _canned("503 Service Unavailable", "too many open connections\n",
                              "retry-after: 1")


class BoundedH11Protocol(H11Protocol):
    """One HTTP/1.1 connection, with the deadlines and the cap of :class:`SocketLimits`.

    uvicorn builds one per accepted socket; pass ``functools.partial(BoundedH11Protocol,
    limits=...)`` as ``uvicorn.Config(http=...)``.
    """

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *,
                 limits: SocketLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._head_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            # Not added to ``connections``: this socket is gone as soon as the answer is out.
            self.transport = transport
            transport.write(SERVICE_UNAVAILABLE)
            transport.close()
            log.warning(REFUSED_MESSAGE + " (limit %d)", self.limits.max_connections)
            return
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel(head=True, body=True)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_deadline is None:
            # The first byte of a request on a kept-alive connection starts its head's clock.
            self._arm_head()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_request()

    def _follow_request(self) -> None:
        """Move the deadlines along with the request: head, then body, then none."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._head_deadline is None and self.conn.trailing_data[0]:
                # Part of a pipelined request was buffered while the previous one ran.
                self._arm_head()
            return
        self._cancel(head=True)
        if state is h11.SEND_BODY:
            if self._body_deadline is None:
                self._body_deadline = self.loop.call_later(self.limits.body_timeout,
                                                           self._body_timed_out)
        else:
            self._cancel(body=True)

    def _arm_head(self) -> None:
        self._head_deadline = self.loop.call_later(self.limits.header_timeout,
                                                   self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()

    def _cancel(self, *, head: bool = False, body: bool = False) -> None:
        if head and self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        if body and self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None


class ThrottleFilter(logging.Filter):
    """Let through one record starting with ``prefix`` per ``interval`` seconds.

    The next record let through says how many were held back. Records that do not
    start with ``prefix`` pass untouched.
    """

    def __init__(self, prefix: str, interval: float = 10.0) -> None:
        super().__init__()
        self.prefix = prefix
        self.interval = interval
        self.suppressed = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.interval:
                self.suppressed += 1
                return False
            self._last = now
            held, self.suppressed = self.suppressed, 0
        if held:
            record.msg = (f"{record.msg}\n({held} similar messages suppressed in the last "
                          f"{self.interval:g} s)")
        return True


# Each refused connection would otherwise log a line: a flood of them would flood the log.
log.addFilter(ThrottleFilter(REFUSED_MESSAGE))
