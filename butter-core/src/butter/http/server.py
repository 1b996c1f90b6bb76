"""``ServeServer``: the HTTP surface of ``butter serve`` for any serve backend, in-process."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import uvicorn

from butter.http.access import AccessPolicy, is_loopback
from butter.http.app import create_app
from butter.http.protocol import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    KEEP_ALIVE,
    MAX_CONNECTIONS,
    BoundedH11Protocol,
    SocketLimits,
    ThrottleFilter,
)
from butter.serving import ServeBackend

log = logging.getLogger("butter.http")

# Without a limit raised above the default 1,024 (256 on macOS), a few hundred
# connections and the model's files exhaust the descriptors. macOS refuses an infinite
# or too large soft limit for files; OPEN_MAX is its documented ceiling.
OPEN_MAX = 10240
# On EMFILE, asyncio logs a traceback per pending connection, every second
# (selector_events._accept_connection): 180 MB of log in 25 s was seen.
LOG_FLOODS = (
    ("asyncio", "socket.accept() out of system resource"),
    ("uvicorn.error", "Invalid HTTP request received."),
)


def raise_open_files_limit() -> int | None:
    """Raise the soft limit on open files as far as allowed; the limit now, if known."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    for target in (hard, min(hard, OPEN_MAX) if hard != resource.RLIM_INFINITY else OPEN_MAX):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            continue
        return target
    return soft


class ServeServer:
    """Serve ``backend`` over HTTP/1.1 with uvicorn until stopped or the engine dies.

    >>> exit_code = await ServeServer(host="127.0.0.1", port=8000, backend=backend).run_forever()

    ``header_timeout``, ``body_timeout`` and ``keep_alive`` are seconds (see
    :mod:`butter.http.protocol`); past ``max_connections``, new connections get a 503.
    Without ``access``, the server answers only to a loopback ``Host`` while bound to a
    loopback address.
    """

    # How often the watchdog asks whether the engine still runs.
    WATCHDOG_INTERVAL = 0.5

    def __init__(self, *, host: str = "127.0.0.1", port: int = 8000, backend: ServeBackend,
                 close_backend_on_shutdown: bool = False,
                 on_listening: Callable[[ServeServer], None] | None = None,
                 log_level: str = "warning", access: AccessPolicy | None = None,
                 header_timeout: float = HEADER_TIMEOUT,
                 body_timeout: float = BODY_TIMEOUT,
                 keep_alive: float = KEEP_ALIVE,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.host = host
        self.port = port
        self.backend = backend
        # 1 once the server stopped because the engine died; ``butter serve`` exits with it.
        self.exit_code = 0
        self.access = access or AccessPolicy(loopback_only=is_loopback(host))
        self.limits = SocketLimits(header_timeout=header_timeout, body_timeout=body_timeout,
                                   keep_alive=keep_alive, max_connections=max_connections)
        self.app = create_app(backend, close_backend_on_shutdown=close_backend_on_shutdown,
                              access=self.access)
        self._on_listening = on_listening
        config = uvicorn.Config(
            self.app, host=host, port=port, lifespan="on", log_level=log_level,
            access_log=False, timeout_graceful_shutdown=5,
            http=functools.partial(BoundedH11Protocol, limits=self.limits),  # type: ignore[arg-type]
            timeout_keep_alive=keep_alive,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=self.limits.max_head_bytes)
        self._server = uvicorn.Server(config)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def started(self) -> bool:
        return self._server.started

    async def run_forever(self) -> int:
        """Serve until :meth:`stop`, SIGINT / SIGTERM, or the engine's death; the exit code."""
        limit = raise_open_files_limit()
        if limit is not None and limit < self.limits.max_connections + 64:
            log.warning("The open-files limit (%d) is below max_connections (%d) plus what "
                        "the model needs; raise it with `ulimit -n`.", limit,
                        self.limits.max_connections)
        filters = [(logging.getLogger(name), ThrottleFilter(prefix)) for name, prefix in LOG_FLOODS]
        for logger, throttle in filters:
            logger.addFilter(throttle)
        task = asyncio.create_task(self._server.serve())
        watchdog = asyncio.create_task(self._watch_engine())
        try:
            if self._on_listening is not None:
                while not self._server.started and not task.done():
                    await asyncio.sleep(0.02)
                if self._server.started:
                    self._on_listening(self)
            await task
        finally:
            watchdog.cancel()
            for logger, throttle in filters:
                logger.removeFilter(throttle)
        return self.exit_code

    def stop(self) -> None:
        self._server.should_exit = True

    async def _watch_engine(self) -> None:
        """Stop serving once the engine has died: a server whose every answer is 503 only
        hides the failure from a supervisor that would restart it."""
        while not self._server.should_exit:
            await asyncio.sleep(self.WATCHDOG_INTERVAL)
            if not self.backend.healthy:
                log.critical("The engine has stopped; shutting the server down.")
                self.exit_code = 1
                self._server.should_exit = True
                return
