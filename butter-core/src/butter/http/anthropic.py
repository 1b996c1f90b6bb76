"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic Messages API).

The body becomes the same :class:`~butter.chat.request.ChatRequest` as on the OpenAI
route (``butter.wire.anthropic``), so both dialects share the engine, its sessions
and tool-call recovery. Errors raised here are rendered in Anthropic's shape by the
app's one exception handler; an error after the stream started is an ``error`` event.
``anthropic-version``, ``x-api-key`` and ``Authorization`` headers are ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request, Response, post
from litestar.response import Stream

from butter.errors import ButterError
from butter.http.common import (
    SSE_HEADERS,
    Backend,
    cancel_on_disconnect,
    read_json,
    sse,
    watch_disconnect,
)
from butter.http.errors import as_butter_error
from butter.serving import Generation
from butter.wire.anthropic import (
    COUNT_TOKENS_SCHEMA,
    MESSAGES_SCHEMA,
    MessageBuilder,
    error_body,
    new_message_id,
    parse_messages_request,
)


@post("/v1/messages", status_code=200,
      opt={"dialect": "anthropic", "body_schema": MESSAGES_SCHEMA})
async def messages(request: Request, backend: Backend) -> Response | Stream:
    chat = parse_messages_request(await read_json(request))
    generation = await backend.generate(chat)
    message = MessageBuilder(message_id=new_message_id(), model=generation.model)
    if chat.stream:
        watch_disconnect(request, generation)
        return Stream(_events(generation, message), media_type="text/event-stream",
                      headers=SSE_HEADERS)
    async with cancel_on_disconnect(request, generation):
        try:
            async for delta in generation:
                message.add(delta)
        finally:
            generation.cancel()
    body = message.message(finish_reason=generation.finish_reason,
                           stop_sequence=generation.stop_sequence, usage=generation.usage)
    return Response(body, media_type="application/json")


async def _events(generation: Generation, message: MessageBuilder) -> AsyncIterator[bytes]:
    try:
        for name, data in message.start(generation.prompt_tokens):
            yield sse(data, event=name)
        async for delta in generation:
            for name, data in message.add(delta):
                yield sse(data, event=name)
        for name, data in message.finish(finish_reason=generation.finish_reason,
                                         stop_sequence=generation.stop_sequence,
                                         usage=generation.usage):
            yield sse(data, event=name)
    except ButterError as error:
        yield sse(error_body(error), event="error")
    except Exception as exc:  # never a traceback on the wire
        yield sse(error_body(as_butter_error(exc)), event="error")
    finally:
        generation.cancel()


@post("/v1/messages/count_tokens", status_code=200,
      opt={"dialect": "anthropic", "body_schema": COUNT_TOKENS_SCHEMA})
async def count_tokens(request: Request, backend: Backend) -> dict:
    chat = parse_messages_request(await read_json(request), for_count=True)
    return {"input_tokens": await backend.count_tokens(chat)}
