"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic Messages API)."""

from __future__ import annotations

from litestar import Request, post

from butter.errors import InvalidRequestError
from butter.serving import ServeBackend


@post("/v1/messages", status_code=200)
async def messages(request: Request, backend: ServeBackend) -> dict:
    raise InvalidRequestError("The Messages API is not implemented yet.")


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request, backend: ServeBackend) -> dict:
    raise InvalidRequestError("The Messages API is not implemented yet.")
