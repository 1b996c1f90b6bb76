"""``POST /v1/chat/completions``: the product path, streamed or not."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from litestar import Request, Response, post
from litestar.response import Stream

from butter.chat.recovery import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallStart
from butter.chat.request import parse_chat_completion
from butter.engine.events import Usage
from butter.errors import ButterError
from butter.http.common import Backend, cancel_on_disconnect, read_json, sse, watch_disconnect
from butter.http.errors import as_butter_error, openai_body
from butter.serving import Generation

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage_body(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "cached_tokens": usage.cached_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, backend: Backend) -> Response | Stream:
    chat = parse_chat_completion(await read_json(request))
    generation = await backend.generate(chat)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    model_id = backend.model_id
    if chat.stream:
        watch_disconnect(request, generation)
        chunks = _stream(generation, completion_id, model_id, include_usage=chat.include_usage)
        return Stream(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
    async with cancel_on_disconnect(request, generation):
        body = await _complete(generation, completion_id, model_id)
    return Response(body, media_type="application/json")


async def _complete(generation: Generation, completion_id: str, model_id: str) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    try:
        async for delta in generation:
            if isinstance(delta, ContentDelta):
                content.append(delta.text)
            elif isinstance(delta, ReasoningDelta):
                reasoning.append(delta.text)
    finally:
        generation.cancel()
    text = "".join(content)
    calls = generation.tool_calls
    message: dict[str, Any] = {"role": "assistant",
                               "content": (text.strip() or None) if calls else text}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": generation.created,
        "model": model_id,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": generation.finish_reason}],
        "usage": usage_body(generation.usage),
    }


async def _stream(generation: Generation, completion_id: str, model_id: str, *,
                  include_usage: bool) -> AsyncIterator[bytes]:
    created = generation.created

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish_reason}]})

    # Content deltas are most of a stream: frame them from a prebuilt template.
    head, tail = chunk({"content": "\x00"}).decode().split('"\\u0000"')

    def content_chunk(text: str) -> bytes:
        return (head + json.dumps(text, ensure_ascii=False) + tail).encode()

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for delta in generation:
            if isinstance(delta, ContentDelta):
                yield content_chunk(delta.text)
            elif isinstance(delta, ReasoningDelta):
                yield chunk({"reasoning_content": delta.text})
            elif isinstance(delta, ToolCallStart):
                yield chunk({"tool_calls": [{"index": delta.index, "id": delta.id,
                                             "type": "function",
                                             "function": {"name": delta.name, "arguments": ""}}]})
            elif isinstance(delta, ToolCallArguments):
                yield chunk({"tool_calls": [{"index": delta.index,
                                             "function": {"arguments": delta.fragment}}]})
        yield chunk({}, generation.finish_reason or "stop")
        if include_usage:
            yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                       "model": model_id, "choices": [], "usage": usage_body(generation.usage)})
    except ButterError as error:
        yield sse(openai_body(error))
    except Exception as exc:  # never a traceback on the wire
        yield sse(openai_body(as_butter_error(exc)))
    finally:
        generation.cancel()
    yield b"data: [DONE]\n\n"
