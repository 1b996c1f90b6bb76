"""Serve backends: what the HTTP edge talks to.

:class:`ButterServeBackend` runs chat requests on one loaded :class:`Model`;
:class:`ResidentServeBackend` keeps one such backend resident and swaps it when a
request names another model. ``butter serve`` is a ``ResidentServeBackend``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from butter.backend import KVSpec
from butter.chat.answer import Answer, AnswerReader
from butter.chat.recovery import Delta, ToolCall
from butter.chat.request import ChatRequest
from butter.engine.events import Admitted, AsyncChannel, Failed
from butter.engine.planner import PREFILL_CHUNK
from butter.engine.promptcache import DEFAULT_MIB
from butter.engine.records import Request
from butter.errors import (
    ButterError,
    ModelLoadError,
    ModelNotFoundError,
    RequestAbortedError,
)
from butter.generation import Usage
from butter.hub import SharedDownloads, download

if TYPE_CHECKING:
    from butter.library import CheckedModel, Model, ModelLoader, Prepared
    from butter.resolve import ResolvedModel

log = logging.getLogger("butter.serve")


class Generation:
    """One chat request running on the engine, read as parsed deltas.

    Iterate it for :class:`~butter.chat.recovery.Delta` objects; afterwards
    ``finish_reason``, ``usage`` and ``tool_calls`` are set. ``cancel()`` stops the
    work at the next bounded work unit (safe to call at any time, more than once).
    ``model`` is the id of the model that answers (what the response names).
    """

    def __init__(self, backend: ButterServeBackend, request: Request, channel: AsyncChannel,
                 reader: AnswerReader) -> None:
        self._backend = backend
        self.model = backend.model_id
        self._request = request
        self._channel = channel
        self._answer = Answer(reader)
        self.id = request.id
        self.created = int(time.time())
        self.prompt_tokens = 0
        self._done = False

    async def admitted(self) -> None:
        """Wait until the engine accepted the prompt; raise its error if it did not."""
        event = await self._channel.get()
        if isinstance(event, Failed):
            self._done = True
            raise event.error
        assert isinstance(event, Admitted)
        self.prompt_tokens = event.prompt_tokens

    async def __aiter__(self) -> AsyncIterator[Delta]:
        answer = self._answer
        for delta in answer.start():
            yield delta
        try:
            while not answer.done:
                for delta in answer.on(await self._channel.get()):
                    yield delta
        finally:
            self._done = self._done or answer.done

    @property
    def finish_reason(self) -> str | None:
        return self._answer.finish_reason

    @property
    def stop_sequence(self) -> str | None:
        """Which of the request's stop strings ended it."""
        return self._answer.stop_sequence

    @property
    def usage(self) -> Usage | None:
        return self._answer.usage

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._answer.tool_calls

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._backend.cancel(self._request)


def choice_requests(request: ChatRequest) -> list[ChatRequest]:
    """``n`` copies of ``request``, one per choice; a seed goes seed, seed+1, ..."""
    if request.n == 1:
        return [request]
    seed = request.params.seed
    return [attrs.evolve(request, n=1, params=attrs.evolve(
        request.params, seed=None if seed is None else seed + index))
        for index in range(request.n)]


def combined_usage(per_prompt: list[list[Usage | None]]) -> Usage:
    """Usage of several choices: each prompt counted once, every completion counted."""
    prompt = cached = completion = accepted = rejected = 0
    for usages in per_prompt:
        known = [u for u in usages if u is not None]
        if known:
            prompt += known[0].prompt_tokens
            cached += known[0].cached_tokens
            completion += sum(u.completion_tokens for u in known)
            accepted += sum(u.accepted_prediction_tokens for u in known)
            rejected += sum(u.rejected_prediction_tokens for u in known)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                 accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)


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
                for one in choice_requests(request):  # n choices: one generation each
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


@runtime_checkable
class ServeBackend(Protocol):
    """What ``butter.http`` needs: the models it serves and chat generations.

    One process serves one resident model; Ray Serve's ingress serves several, one
    deployment each (``model_cards`` lists them all, ``model_id`` is the one a request
    naming no model gets).
    """

    @property
    def model_id(self) -> str: ...

    @property
    def healthy(self) -> bool:
        """False once the engine has stopped on its own: ``/health`` answers 503."""

    def model_card(self) -> dict: ...

    def model_cards(self) -> list[dict]:
        """Every model served, ``model_card()`` first (``/v1/models``)."""

    async def generate(self, request: ChatRequest) -> Generation: ...

    async def count_tokens(self, request: ChatRequest) -> int: ...

    def metrics_text(self) -> str: ...

    async def aclose(self) -> None: ...


class ButterServeBackend:
    """Serves one loaded :class:`~butter.library.Model` with a bounded session pool."""

    def __init__(self, model: Model, *, model_id: str | None = None,
                 maximum_concurrent_requests: int = 1, max_context: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, kv: KVSpec | None = None,
                 backend_options: Mapping[str, Mapping[str, object]] | None = None,
                 enable_thinking: bool | None = None,
                 reasoning_effort: str | None = None, speculation: str = "ngram",
                 cache_ram: int = DEFAULT_MIB) -> None:
        self.model = model
        self._model_id = model_id or model.model_id
        self.enable_thinking = enable_thinking
        self.reasoning_effort = reasoning_effort
        self.engine = model.start_engine(model.engine_config(
            parallel=maximum_concurrent_requests, capacity=max_context,
            prefill_chunk=prefill_chunk, kv=kv, speculation=speculation, cache_ram=cache_ram,
            options=(backend_options or {}).get(model.backend.name)))

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def healthy(self) -> bool:
        return not self.engine.died

    @property
    def key(self) -> str:
        """The checkpoint's identity: ids that resolve to the same key need no swap."""
        return self.model.key

    def model_card(self) -> dict:
        info = self.model.info
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.model.loaded_at,
            "owned_by": "butter",
            "max_model_len": self.engine.capacity,
            "context_length": self.engine.capacity,
            "butter": {
                "backend": self.model.backend_name,
                "architecture": info.architecture,
                "n_ctx_train": info.n_ctx_train,
                "parallel": self.engine.config.parallel,
                "fused_batching": self.engine.fused,
                **self.engine.runtime_facts,
            },
        }

    def model_cards(self) -> list[dict]:
        return [self.model_card()]

    def _prepare(self, request: ChatRequest) -> Prepared:
        return self.model.prepare(request, default_thinking=self.enable_thinking,
                                  default_effort=self.reasoning_effort)

    async def generate(self, request: ChatRequest) -> Generation:
        # Rendering and tokenizing run on a worker thread: neither the event loop nor the
        # engine thread waits for a large prompt.
        prepared = await asyncio.to_thread(self._prepare, request)
        channel = AsyncChannel()
        engine_request = Request(prepared.tokens, request.params, channel, prepared.constraint,
                                 tail=prepared.tail)
        generation = Generation(self, engine_request, channel, prepared.reader)
        self.engine.submit(engine_request)
        try:
            await generation.admitted()
        except asyncio.CancelledError:
            self.cancel(engine_request)
            raise
        return generation

    async def count_tokens(self, request: ChatRequest) -> int:
        prepared = await asyncio.to_thread(self._prepare, request)
        return len(prepared.tokens)

    def cancel(self, request: Request) -> None:
        self.engine.cancel(request)

    def metrics_text(self) -> str:
        return self.engine.metrics.render(model_id=self.model_id, fused=self.engine.fused)

    def close(self, error: ButterError | None = None) -> None:
        self.model.close(error)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


class ResidentServeBackend:
    """One resident model, swapped when a request names another model it may load.

    ``loader`` (a :class:`~butter.library.ModelLoader`, or a callable ``id -> Model``
    wrapped in one) decides which ids a request may name and loads them. A swap pre-checks
    the new checkpoint first (a file it refuses aborts nothing), then aborts the old
    model's requests, frees it and loads the new one; if that fails, the old one is
    loaded again and keeps serving.
    ``allow_swap=False`` answers 404 instead.

    A hub id not cached yet is 404 unless the loader allows downloads
    (``--allow-downloads``): then it downloads on a worker thread while the resident
    model keeps serving everyone (``downloads``: one download per id, shared by the
    requests that name it), and only once it is whole and resolves does the swap begin.
    """

    def __init__(self, loader: ModelLoader | Callable[[str], Model], initial: str, *,
                 allow_swap: bool = True, alias: str | None = None, **backend_options) -> None:
        from butter.library import ModelLoader

        if not isinstance(loader, ModelLoader):  # a plain loader callable
            loader = ModelLoader(factory=loader)
        self._loader = loader
        self._options = backend_options
        self.allow_swap = allow_swap
        self._initial = initial
        self._alias = alias  # the initial checkpoint's served id (--alias), if given
        self._lock = asyncio.Lock()
        target = loader.download_target(initial, trusted=True)
        if target is not None:  # the operator's own id: fetched as `butter serve` does
            download(target)
        self._checked = loader.check(loader.find(initial, trusted=True))
        self._initial_key = self._checked.resolved.key
        self._current = self._build(self._checked)
        self.swaps = 0
        self.downloads = SharedDownloads()

    def _build(self, checked: CheckedModel) -> ButterServeBackend:
        model = self._loader.load(checked)
        try:
            served = self._alias if self._alias and checked.resolved.key == self._initial_key \
                else checked.model_id
            return ButterServeBackend(model, model_id=served, **self._options)
        except BaseException:
            model.close()
            raise

    @property
    def current(self) -> ButterServeBackend:
        return self._current

    @property
    def model_id(self) -> str:
        return self._current.model_id

    @property
    def healthy(self) -> bool:
        return self._current.healthy

    def model_card(self) -> dict:
        return self._current.model_card()

    def model_cards(self) -> list[dict]:
        return [self.model_card()]

    def metrics_text(self) -> str:
        return self._current.metrics_text()

    def _find(self, model_id: str) -> ResolvedModel:
        return self._loader.find(model_id, trusted=model_id == self._initial)

    async def backend_for(self, model_id: str | None) -> ButterServeBackend:
        if (not model_id or model_id == self._current.model_id) and not self._lock.locked():
            return self._current
        resolved = await self._resolve(model_id) if model_id else None
        async with self._lock:
            if resolved is not None and resolved.key != self._current.key:
                if not self.allow_swap:
                    raise ModelNotFoundError(model_id, "This server does not swap models "
                                             "(--no-swap).")
                await self._swap(resolved)
            return self._current

    async def _resolve(self, model_id: str) -> ResolvedModel:
        """Resolve ``model_id``, downloading it first when the loader allows that. The
        download holds no lock: the resident model serves on while it runs."""
        if self._alias is not None and model_id == self._alias:
            model_id = self._initial
        trusted = model_id == self._initial
        target = await asyncio.to_thread(self._loader.download_target, model_id,
                                         trusted=trusted)
        if target is not None:
            if not self.allow_swap:
                raise ModelNotFoundError(model_id, "This server does not swap models "
                                         "(--no-swap).")
            await self.downloads.fetch(target)
        return await asyncio.to_thread(self._find, model_id)

    async def _swap(self, resolved: ResolvedModel) -> None:
        old, old_checked = self._current, self._checked
        log.info("swap requested: %s -> %s", old.model_id, resolved.model_id)
        checked = await asyncio.to_thread(self._loader.check, resolved)
        aborted = RequestAbortedError(
            f"The resident model is being swapped to `{resolved.model_id}`.")
        await asyncio.to_thread(old.close, aborted)
        try:
            self._current = await asyncio.to_thread(self._build, checked)
            self._checked = checked
        except Exception as exc:
            log.warning("swap to %s failed (%s); reloading %s", resolved.model_id, exc,
                        old.model_id)
            self._current = await asyncio.to_thread(self._build, old_checked)
            if isinstance(exc, ButterError):
                raise
            raise ModelLoadError(resolved.model_id, "the back end failed to load it") from exc
        self.swaps += 1
        log.info("swap done: now serving %s", resolved.model_id)

    async def generate(self, request: ChatRequest) -> Generation:
        backend = await self.backend_for(request.model)
        return await backend.generate(request)

    async def count_tokens(self, request: ChatRequest) -> int:
        backend = await self.backend_for(request.model)
        return await backend.count_tokens(request)

    async def aclose(self) -> None:
        await self._current.aclose()
