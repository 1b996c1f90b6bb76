"""``create_app``: the litestar application serving one :class:`ServeBackend`."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Litestar, MediaType, Request, Response, get
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.params import PathParameter
from prometheus_client import CONTENT_TYPE_LATEST

from butter.errors import ModelNotFoundError
from butter.http.access import AccessPolicy, access_middleware
from butter.http.common import MAX_BODY_BYTES, Backend
from butter.http.errors import handle_exception
from butter.http.openai import chat_completions, completions
from butter.http.schema import REQUEST_BODIES
from butter.serving import ServeBackend

ROUTES = (
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{id}"),
    ("GET", "/metrics"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/schema/openapi.json"),
)


@get("/health", media_type=MediaType.TEXT)
async def health(backend: Backend) -> Response:
    """``ok`` while the engine runs; 503 once it has stopped (the process is exiting)."""
    if not backend.healthy:
        return Response("engine stopped", status_code=503, media_type=MediaType.TEXT)
    return Response("ok", media_type=MediaType.TEXT)


@get("/v1/models")
async def list_models(backend: Backend) -> dict:
    return {"object": "list", "data": [backend.model_card()]}


@get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: Annotated[str, PathParameter()], backend: Backend) -> dict:
    """The resident model's card (the SDK's ``models.retrieve``); any other id is 404."""
    model_id = model_id.lstrip("/")
    card = backend.model_card()
    if model_id != card["id"]:
        raise ModelNotFoundError(model_id)
    return card


@get("/metrics", media_type=MediaType.TEXT)
async def metrics(backend: Backend) -> Response:
    """The Prometheus text exposition of the resident model's engine."""
    # The content type as prometheus_client spells it: as a media type, litestar would
    # append a second charset.
    return Response(backend.metrics_text(), media_type=MediaType.TEXT,
                    headers={"content-type": CONTENT_TYPE_LATEST})


class SchemaPlugin(JsonRenderPlugin):
    """litestar's OpenAPI JSON, with the request bodies the routes read themselves."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, with_request_bodies(openapi_schema))


def with_request_bodies(openapi_schema: dict[str, Any]) -> dict[str, Any]:
    paths = dict(openapi_schema.get("paths", {}))
    for path, body in REQUEST_BODIES.items():
        if "post" in paths.get(path, {}):
            post = dict(paths[path]["post"], requestBody={
                "required": True, "content": {"application/json": {"schema": body}}})
            paths[path] = dict(paths[path], post=post)
    return dict(openapi_schema, paths=paths)


def create_app(backend: ServeBackend, *, close_backend_on_shutdown: bool = False,
               access: AccessPolicy | None = None) -> Litestar:
    """The HTTP surface of ``butter serve`` over ``backend``."""
    from butter.http.anthropic import count_tokens, messages

    async def on_shutdown() -> None:
        if close_backend_on_shutdown:
            await backend.aclose()

    return Litestar(
        route_handlers=[health, list_models, retrieve_model, metrics, chat_completions,
                        completions, messages, count_tokens],
        dependencies={"backend": Provide(lambda: backend, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        middleware=[access_middleware(access or AccessPolicy())],
        on_shutdown=[on_shutdown],
        openapi_config=OpenAPIConfig(title="butter", version="0.1.0", path="/schema",
                                     render_plugins=[SchemaPlugin()]),
        request_max_body_size=MAX_BODY_BYTES,
        debug=False,
    )
