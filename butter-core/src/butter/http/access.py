"""Who may talk to the server: browsers' origins, the ``Host`` header, the API key.

A web page the operator visits can send requests to a local server: a cross-site
POST with a plain content type needs no pre-flight, and DNS rebinding lets a page
read the answers. As Ollama does, butter refuses a request whose ``Origin`` is not
allowed (default: the localhost origins) with 403, answers CORS pre-flights for the
allowed ones, and, while bound to loopback, answers only to a loopback ``Host``.
Clients that are not browsers send no ``Origin``, so ``curl -d`` keeps working.

With ``api_key`` set, every ``/v1/`` route needs ``Authorization: Bearer KEY`` (or
Anthropic's ``x-api-key: KEY``); without it, those headers are ignored.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs

from butter.errors import AuthenticationError, ButterError, ForbiddenError
from butter.http.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_ALLOWED_ORIGINS = tuple(
    f"{scheme}://{host}{port}"
    for scheme in ("http", "https")
    for host in ("localhost", "127.0.0.1", "[::1]")
    for port in ("", ":*")
)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
PREFLIGHT_HEADERS = {
    "access-control-allow-methods": "GET, POST, OPTIONS",
    "access-control-max-age": "600",
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, maybe bracketed) names this machine only."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def origin_allowed(origin: str, patterns: Iterable[str]) -> bool:
    """``patterns`` are exact origins, ``*`` (any), or ``scheme://host:*`` (any port)."""
    origin = origin.lower().rstrip("/")
    for pattern in patterns:
        pattern = pattern.lower().rstrip("/")
        if pattern == "*" or pattern == origin:
            return True
        if pattern.endswith(":*"):
            stem = pattern[:-2]
            port = origin[len(stem) + 1:] if origin.startswith(stem + ":") else ""
            if port.isdigit():
                return True
    return False


@attrs.frozen
class AccessPolicy:
    allowed_origins: tuple[str, ...] = DEFAULT_ALLOWED_ORIGINS
    api_key: str | None = None
    # True when the server is bound to a loopback address (``ServeServer`` knows; an app
    # embedded elsewhere does not, so the default checks no Host).
    loopback_only: bool = False

    def refusal(self, scope: Scope, headers: dict[str, str]) -> ButterError | None:
        """Why this request may not be served, or None."""
        host = headers.get("host")
        if self.loopback_only and host and not is_loopback(_host_name(host)):
            return ForbiddenError("This server answers only to a loopback Host while bound "
                                  "to loopback (DNS rebinding protection).")
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, self.allowed_origins):
            return ForbiddenError(f"Origin `{origin}` is not allowed (see --allowed-origins).")
        if self.api_key and scope["path"].startswith("/v1/") and not self._has_key(headers):
            return AuthenticationError("A valid API key is required (Authorization: Bearer "
                                       "KEY).")
        return None

    def _has_key(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        offered = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")
        return hmac.compare_digest(offered.encode(), self.api_key.encode())


def access_middleware(policy: AccessPolicy) -> Callable[[ASGIApp], ASGIApp]:
    """A litestar middleware factory enforcing ``policy`` on every HTTP request."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", ())}
            preflight = (scope["method"] == "OPTIONS"
                         and "access-control-request-method" in headers)
            error = policy.refusal(dict(scope, path="") if preflight else scope, headers)
            if error is not None:
                await _respond(send, error.status_code, error_body(error, scope))
                return
            origin = headers.get("origin")
            if preflight and origin is not None:
                allow = {**PREFLIGHT_HEADERS, "access-control-allow-origin": origin,
                         "vary": "Origin",
                         "access-control-allow-headers":
                             headers.get("access-control-request-headers", "")}
                await _respond(send, 204, None, allow)
                return
            if origin is None:
                await app(scope, receive, send)
                return

            async def send_with_cors(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()),
                                          (b"access-control-allow-origin", origin.encode()),
                                          (b"vary", b"Origin")]
                await send(message)

            await app(scope, receive, send_with_cors)

        return guarded

    return wrap


async def _respond(send: Send, status: int, body: dict | None,
                   headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode() if body is not None else b""
    pairs = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if body is not None:
        pairs.append((b"content-type", b"application/json"))
    pairs.append((b"content-length", str(len(raw)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": pairs})
    await send({"type": "http.response.body", "body": raw})
