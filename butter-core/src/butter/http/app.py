"""``create_app``: the litestar application serving one :class:`ServeBackend`."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from litestar import Litestar, MediaType, Request, Response, get
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.params import PathParameter
from prometheus_client import CONTENT_TYPE_LATEST

from butter.errors import ModelNotFoundError
from butter.http.access import AccessPolicy, access_middleware
from butter.http.anthropic import count_tokens, messages
from butter.http.common import MAX_BODY_BYTES, Backend
from butter.http.errors import handle_exception
from butter.http.openai import chat_completions, completions
from butter.serving import ServeBackend

SCHEMA_PATH = "/schema"  # litestar serves the OpenAPI document under it


@get("/health", media_type=MediaType.TEXT)
async def health(backend: Backend) -> Response:
    """``ok`` while the engine runs; 503 once it has stopped (the process is exiting)."""
    if not backend.healthy:
        return Response("engine stopped", status_code=503, media_type=MediaType.TEXT)
    return Response("ok", media_type=MediaType.TEXT)


@get("/v1/models")
async def list_models(backend: Backend) -> dict:
    return {"object": "list", "data": backend.model_cards()}


@get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: Annotated[str, PathParameter()], backend: Backend) -> dict:
    """A served model's card (the SDK's ``models.retrieve``); any other id is 404."""
    model_id = model_id.lstrip("/")
    for card in backend.model_cards():
        if card["id"] == model_id:
            return card
    raise ModelNotFoundError(model_id)


@get("/metrics", media_type=MediaType.TEXT)
async def metrics(backend: Backend) -> Response:
    """The Prometheus text exposition of the resident model's engine (on Ray Serve, every
    replica's and their sum, which takes asking them: there it is awaited)."""
    text = backend.metrics_text()
    if inspect.isawaitable(text):
        text = await text
    # The content type as prometheus_client spells it: as a media type, litestar would
    # append a second charset.
    return Response(text, media_type=MediaType.TEXT,
                    headers={"content-type": CONTENT_TYPE_LATEST})


class SchemaPlugin(JsonRenderPlugin):
    """litestar's OpenAPI JSON, with the request bodies the routes read themselves."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, with_request_bodies(openapi_schema))


def with_request_bodies(openapi_schema: dict[str, Any]) -> dict[str, Any]:
    paths = dict(openapi_schema.get("paths", {}))
    for path, body in request_bodies().items():
        if "post" in paths.get(path, {}):
            post = dict(paths[path]["post"], requestBody={
                "required": True, "content": {"application/json": {"schema": body}}})
            paths[path] = dict(paths[path], post=post)
    return dict(openapi_schema, paths=paths)


HANDLERS = (health, list_models, retrieve_model, metrics, chat_completions, completions,
            messages, count_tokens)
# What `butter serve` announces: derived from the handlers, never a second list.
ROUTES = tuple((method, path) for handler in HANDLERS
               for path in sorted(handler.paths) for method in sorted(handler.http_methods)) \
    + (("GET", f"{SCHEMA_PATH}/openapi.json"),)


def request_bodies() -> dict[str, dict[str, Any]]:
    """Each POST route's body schema, as its handler declares it (``opt["body_schema"]``)."""
    return {path: handler.opt["body_schema"] for handler in HANDLERS
            if "body_schema" in handler.opt for path in handler.paths}


def create_app(backend: ServeBackend, *, close_backend_on_shutdown: bool = False,
               access: AccessPolicy | None = None) -> Litestar:
    """The HTTP surface of ``butter serve`` over ``backend``."""

    async def on_shutdown() -> None:
        if close_backend_on_shutdown:
            await backend.aclose()

    return Litestar(
        route_handlers=list(HANDLERS),
        dependencies={"backend": Provide(lambda: backend, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        middleware=[access_middleware(access or AccessPolicy())],
        on_shutdown=[on_shutdown],
        openapi_config=OpenAPIConfig(title="butter", version="0.1.0", path=SCHEMA_PATH,
                                     render_plugins=[SchemaPlugin()]),
        request_max_body_size=MAX_BODY_BYTES,
        debug=False,
    )
