"""``POST /v1/chat/completions`` and the legacy ``POST /v1/completions``, streamed or not.

A request with ``n`` choices (or, on ``/v1/completions``, several prompts) runs one
generation per choice on the engine, side by side (``serving.Choices``); their deltas
are interleaved on one stream, each chunk naming its choice's index. The bodies and
chunks are ``butter.wire.openai``'s.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from litestar import Request, Response, post
from litestar.response import Stream

from butter.chat.request import ChatRequest
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
from butter.serving import Choices, ServeBackend
from butter.wire.openai import (
    CHAT_COMPLETION_SCHEMA,
    COMPLETION_SCHEMA,
    ChunkWriter,
    CompletionBuilder,
    error_body,
    parse_chat_completion,
    parse_completion,
)


@post("/v1/chat/completions", status_code=200,
      opt={"dialect": "openai", "body_schema": CHAT_COMPLETION_SCHEMA})
async def chat_completions(request: Request, backend: Backend) -> Response | Stream:
    chat = parse_chat_completion(await read_json(request))
    return await _respond(request, backend, [chat], chat=True)


@post("/v1/completions", status_code=200,
      opt={"dialect": "openai", "body_schema": COMPLETION_SCHEMA})
async def completions(request: Request, backend: Backend) -> Response | Stream:
    """The legacy text-completion route: raw prompts, no chat template."""
    return await _respond(request, backend, parse_completion(await read_json(request)),
                          chat=False)


async def _respond(request: Request, backend: ServeBackend, asked: list[ChatRequest], *,
                   chat: bool) -> Response | Stream:
    choices = await Choices.start(backend, asked)  # n choices each, side by side
    first = asked[0]
    completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    model = choices.generations[0].model  # the model that answers, of those served
    writer = ChunkWriter(completion_id=completion_id, model=model,
                         created=choices.created, text=not chat)
    echoes = [asked[p].raw_prompt or "" if asked[p].echo else "" for p in choices.prompts]
    if first.stream:
        watch_disconnect(request, choices)
        return Stream(_stream(choices, writer, echoes, include_usage=first.include_usage),
                      media_type="text/event-stream", headers=SSE_HEADERS)
    async with cancel_on_disconnect(request, choices):
        body = await _whole(choices, model, completion_id, echoes, chat=chat,
                            logprobs=first.params.logprobs is not None)
    return Response(body, media_type="application/json")


async def _whole(choices: Choices, model: str, completion_id: str, echoes: list[str], *,
                 chat: bool, logprobs: bool) -> dict:
    builder = CompletionBuilder(echoes=echoes, chat=chat, logprobs=logprobs)
    try:
        async for index, delta in choices.deltas():
            builder.add(index, delta)
    finally:
        choices.cancel()
    generations = choices.generations
    return builder.body(completion_id=completion_id, model=model, created=choices.created,
                        finish_reasons=[g.finish_reason for g in generations],
                        calls=[g.tool_calls for g in generations], usage=choices.usage())


async def _stream(choices: Choices, writer: ChunkWriter, echoes: list[str], *,
                  include_usage: bool) -> AsyncIterator[bytes]:
    try:
        for index, echo in enumerate(echoes):
            opening = writer.opening(index)
            if opening is not None:
                yield sse(opening)
            if echo:
                yield sse(writer.text(echo, index))
        async for index, delta in choices.deltas():
            if delta is None:
                yield sse(writer.closing(choices.generations[index].finish_reason, index))
                continue
            chunk = writer.delta(delta, index)
            if chunk is not None:
                yield sse(chunk)
        if include_usage:
            yield sse(writer.usage(choices.usage()))
    except ButterError as error:
        yield sse(error_body(error))
    except Exception as exc:  # never a traceback on the wire
        yield sse(error_body(as_butter_error(exc)))
    finally:
        choices.cancel()
    yield b"data: [DONE]\n\n"
