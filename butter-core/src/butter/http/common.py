"""Helpers every route shares: body reading, SSE framing, disconnect watching."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request
from litestar.di import NamedDependency
from litestar.exceptions import InternalServerException

from butter.errors import ClientDisconnectedError
from butter.serving import Generation, ServeBackend
from butter.wire.fields import parse_json_body

log = logging.getLogger("butter.http")

# Handlers receive the serve backend by name (`backend: Backend`).
Backend = NamedDependency[ServeBackend]


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# One body limit for every route (litestar refuses larger bodies with 413).
MAX_BODY_BYTES = 10 * 1024 * 1024


async def read_json(request: Request) -> dict[str, Any]:
    try:
        raw = await request.body()
    except InternalServerException as exc:  # litestar's word for a client gone mid-upload
        if "disconnected" not in str(exc.detail):
            raise
        log.info("%s %s: the client went away before its body arrived", request.method,
                 request.url.path)
        raise ClientDisconnectedError() from None
    return parse_json_body(raw)


def sse(data: Any, *, event: str | None = None) -> bytes:
    """One server-sent event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                          separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def watch_disconnect(request: Request, generation: Generation) -> asyncio.Task:
    """Cancel ``generation`` the moment the client closes the connection.

    The body has been read, so the next ASGI message is ``http.disconnect``: it comes
    when the client goes away, or once the response is complete (then cancelling is a
    no-op). This also covers a stream whose body never started.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                generation.cancel()
                return

    return asyncio.create_task(watch())


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, generation: Generation) -> AsyncIterator[None]:
    """Watch for a disconnect while the block runs (non-streaming answers)."""
    task = watch_disconnect(request, generation)
    try:
        yield
    finally:
        task.cancel()
