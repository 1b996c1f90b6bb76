"""``POST /v1/chat/completions`` and the legacy ``POST /v1/completions``, streamed or not.

A request with ``n`` choices (or, on ``/v1/completions``, several prompts) runs one
generation per choice on the engine, side by side; their deltas are interleaved on
one stream, each chunk naming its choice's index.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

from litestar import Request, Response, post
from litestar.response import Stream

from butter.chat.recovery import ContentDelta, Delta, ReasoningDelta
from butter.chat.request import ChatRequest
from butter.errors import ButterError
from butter.generation import LogprobsDelta
from butter.http.common import (
    SSE_HEADERS,
    Backend,
    cancel_on_disconnect,
    read_json,
    sse,
    watch_disconnect,
)
from butter.http.errors import as_butter_error, openai_body
from butter.serving import Generation, ServeBackend
from butter.wire.openai import (
    ChunkWriter,
    chat_choice,
    choice_requests,
    combined_usage,
    completion_body,
    parse_chat_completion,
    parse_completion,
    text_choice,
    text_completion_body,
)


class Choices:
    """The generations of one response, in choice order; cancelling cancels them all."""

    def __init__(self, generations: list[Generation], prompts: list[int]) -> None:
        self.generations = generations
        self.prompts = prompts  # which prompt each choice answers (for usage)

    @classmethod
    async def start(cls, backend: ServeBackend, requests: Sequence[ChatRequest]) -> Choices:
        generations: list[Generation] = []
        prompts: list[int] = []
        try:
            for prompt, request in enumerate(requests):
                for one in choice_requests(request):
                    generations.append(await backend.generate(one))
                    prompts.append(prompt)
        except BaseException:
            for generation in generations:
                generation.cancel()
            raise
        return cls(generations, prompts)

    def cancel(self) -> None:
        for generation in self.generations:
            generation.cancel()

    @property
    def created(self) -> int:
        return self.generations[0].created

    def usage(self):
        groups: dict[int, list] = {}
        for prompt, generation in zip(self.prompts, self.generations):
            groups.setdefault(prompt, []).append(generation.usage)
        return combined_usage(list(groups.values()))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta | None]]:
        """``(choice, delta)`` as they come; ``(choice, None)`` when a choice ends."""
        if len(self.generations) == 1:
            async for delta in self.generations[0]:
                yield 0, delta
            yield 0, None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for delta in generation:
                    await queue.put((index, delta))
                await queue.put((index, None))
            except BaseException as exc:  # handed to the reader, which raises it
                await queue.put((index, exc))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            for _ in range(len(tasks)):
                while True:
                    index, item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield index, item
                    if item is None:
                        break
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, backend: Backend) -> Response | Stream:
    chat = parse_chat_completion(await read_json(request))
    return await _respond(request, backend, [chat], chat=True)


@post("/v1/completions", status_code=200)
async def completions(request: Request, backend: Backend) -> Response | Stream:
    """The legacy text-completion route: raw prompts, no chat template."""
    return await _respond(request, backend, parse_completion(await read_json(request)),
                          chat=False)


async def _respond(request: Request, backend: ServeBackend, asked: list[ChatRequest], *,
                   chat: bool) -> Response | Stream:
    choices = await Choices.start(backend, asked)
    first = asked[0]
    completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    writer = ChunkWriter(completion_id=completion_id, model=backend.model_id,
                         created=choices.created, text=not chat)
    echoes = [asked[p].raw_prompt or "" if asked[p].echo else "" for p in choices.prompts]
    if first.stream:
        watch_disconnect(request, choices)
        return Stream(_stream(choices, writer, echoes, include_usage=first.include_usage),
                      media_type="text/event-stream", headers=SSE_HEADERS)
    async with cancel_on_disconnect(request, choices):
        body = await _whole(choices, backend.model_id, completion_id, echoes, chat=chat,
                            logprobs=first.params.logprobs is not None)
    return Response(body, media_type="application/json")


async def _whole(choices: Choices, model: str, completion_id: str, echoes: list[str], *,
                 chat: bool, logprobs: bool) -> dict:
    count = len(choices.generations)
    content: list[list[str]] = [[echo] for echo in echoes]
    reasoning: list[list[str]] = [[] for _ in range(count)]
    entries: list[list | None] = [[] if logprobs else None for _ in range(count)]
    try:
        async for index, delta in choices.deltas():
            if isinstance(delta, ContentDelta):
                content[index].append(delta.text)
            elif isinstance(delta, ReasoningDelta):
                reasoning[index].append(delta.text)
            elif isinstance(delta, LogprobsDelta) and logprobs:
                entries[index].extend(delta.entries)
    finally:
        choices.cancel()
    generations = choices.generations
    if chat:
        return completion_body(
            completion_id=completion_id, model=model, created=choices.created,
            choices=[chat_choice(index=i, content="".join(content[i]),
                                 reasoning="".join(reasoning[i]),
                                 calls=generations[i].tool_calls,
                                 finish_reason=generations[i].finish_reason,
                                 logprobs=entries[i])
                     for i in range(count)],
            usage=choices.usage())
    return text_completion_body(
        completion_id=completion_id, model=model, created=choices.created,
        choices=[text_choice(index=i, text="".join(content[i]),
                             finish_reason=generations[i].finish_reason,
                             logprobs=entries[i])
                 for i in range(count)],
        usage=choices.usage())


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
        yield sse(openai_body(error))
    except Exception as exc:  # never a traceback on the wire
        yield sse(openai_body(as_butter_error(exc)))
    finally:
        choices.cancel()
    yield b"data: [DONE]\n\n"
