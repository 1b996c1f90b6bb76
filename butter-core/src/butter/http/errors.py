"""The one mapping from exceptions to HTTP error bodies.

Each wire dialect renders its own error body (``butter.wire.openai.error_body``,
``butter.wire.anthropic.error_body``); a route declares its dialect in its handler's
``opt``. A 500 never carries exception text or a traceback.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import Scope

from butter.errors import ButterError, InternalError, InvalidRequestError
from butter.wire import anthropic, openai

log = logging.getLogger("butter.http")

DIALECTS = {"openai": openai, "anthropic": anthropic}  # each renders its own error body

def as_butter_error(exc: Exception) -> ButterError:
    if isinstance(exc, ButterError):
        return exc
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        error = InvalidRequestError(str(exc.detail))
        error.status_code = exc.status_code
        error.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code,
                                                                      "invalid_request")
        return error
    log.error("unexpected error", exc_info=exc)
    return InternalError()


def error_body(error: ButterError, scope: Scope) -> dict:
    """``error`` in the dialect of the route ``scope`` reached: the one its handler
    declares (``opt={"dialect": ...}``), else the one whose routes the path is under."""
    handler = scope.get("route_handler")
    name = handler.opt.get("dialect") if handler is not None else None
    if name is None:
        name = "anthropic" if scope["path"].startswith(anthropic.ROUTE_PREFIX) else "openai"
    return DIALECTS[name].error_body(error)


def handle_exception(request: Request, exc: Exception) -> Response:
    error = as_butter_error(exc)
    # litestar's own headers (``Allow`` on a 405) go out with the error body.
    headers = exc.headers if isinstance(exc, HTTPException) and exc.status_code < 500 else None
    return Response(content=error_body(error, request.scope), status_code=error.status_code,
                    media_type="application/json", headers=headers)
