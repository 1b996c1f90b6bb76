"""``ServeServer``: the HTTP surface of ``butter serve`` for any serve backend, in-process."""

from __future__ import annotations

import asyncio
from typing import Callable

import uvicorn

from butter.http.app import create_app
from butter.serving import ServeBackend


class ServeServer:
    """Serve ``backend`` over HTTP/1.1 with uvicorn until stopped.

    >>> await ServeServer(host="127.0.0.1", port=8000, backend=backend).run_forever()
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 8000, backend: ServeBackend,
                 close_backend_on_shutdown: bool = False,
                 on_listening: Callable[["ServeServer"], None] | None = None,
                 log_level: str = "warning") -> None:
        self.host = host
        self.port = port
        self.backend = backend
        self.app = create_app(backend, close_backend_on_shutdown=close_backend_on_shutdown)
        self._on_listening = on_listening
        config = uvicorn.Config(self.app, host=host, port=port, http="h11", lifespan="on",
                                log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def started(self) -> bool:
        return self._server.started

    async def run_forever(self) -> None:
        """Serve until :meth:`stop` is called or the process gets SIGINT / SIGTERM."""
        task = asyncio.create_task(self._server.serve())
        if self._on_listening is not None:
            while not self._server.started and not task.done():
                await asyncio.sleep(0.02)
            if self._server.started:
                self._on_listening(self)
        await task

    def stop(self) -> None:
        self._server.should_exit = True
