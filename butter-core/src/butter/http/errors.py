"""The one mapping from exceptions to HTTP error bodies.

OpenAI envelope ``{"error": {"message", "type", "param", "code"}}`` everywhere,
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under
``/v1/messages``. A 500 never carries exception text or a traceback.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from butter.errors import ButterError, InternalError, InvalidRequestError

log = logging.getLogger("butter.http")

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


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


def openai_body(error: ButterError) -> dict:
    return {"error": {"message": error.message, "type": error.error_type,
                      "param": error.param, "code": error.code}}


def anthropic_body(error: ButterError) -> dict:
    kind = ANTHROPIC_TYPES.get(error.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(error: ButterError, path: str) -> dict:
    return anthropic_body(error) if is_anthropic_path(path) else openai_body(error)


def handle_exception(request: Request, exc: Exception) -> Response:
    error = as_butter_error(exc)
    # litestar's own headers (``Allow`` on a 405) go out with the error body.
    headers = exc.headers if isinstance(exc, HTTPException) and exc.status_code < 500 else None
    return Response(content=error_body(error, request.url.path), status_code=error.status_code,
                    media_type="application/json", headers=headers)
