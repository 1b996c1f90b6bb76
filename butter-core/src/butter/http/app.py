"""``create_app``: the litestar application serving one :class:`ServeBackend`."""

from __future__ import annotations

from litestar import Litestar, MediaType, Response, get
from litestar.di import Provide

from butter.http.common import Backend
from butter.http.errors import handle_exception
from butter.http.openai import chat_completions
from butter.serving import ServeBackend

ROUTES = (
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
)


@get("/health", media_type=MediaType.TEXT)
async def health() -> str:
    return "ok"


@get("/v1/models")
async def list_models(backend: Backend) -> dict:
    return {"object": "list", "data": [backend.model_card()]}


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(backend: Backend) -> Response:
    return Response(backend.metrics_text(), media_type="text/plain; version=0.0.4")


def create_app(backend: ServeBackend, *, close_backend_on_shutdown: bool = False) -> Litestar:
    """The HTTP surface of ``butter serve`` over ``backend``."""
    from butter.http.anthropic import count_tokens, messages

    async def on_shutdown() -> None:
        if close_backend_on_shutdown:
            await backend.aclose()

    return Litestar(
        route_handlers=[health, list_models, metrics, chat_completions, messages, count_tokens],
        dependencies={"backend": Provide(lambda: backend, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        on_shutdown=[on_shutdown],
        openapi_config=None,
        debug=False,
    )
