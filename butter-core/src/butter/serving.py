"""Serve backends: what the HTTP edge talks to.

:class:`ButterServeBackend` runs chat requests on one loaded :class:`Model`;
:class:`ResidentServeBackend` keeps one such backend resident and swaps it when a
request names another model. ``butter serve`` is a ``ResidentServeBackend``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, runtime_checkable

from butter.chat.prompt import PromptPlan, build_prompt
from butter.chat.answer import AnswerReader
from butter.chat.recovery import Delta, ToolCall
from butter.chat.request import ChatRequest
from butter.engine.events import Admitted, AsyncChannel, Failed, Finished, TextDelta, Usage
from butter.engine.records import Request
from butter.engine.scheduler import EngineConfig
from butter.errors import (
    ButterError,
    InternalError,
    ModelNotFoundError,
    RequestAbortedError,
)

if TYPE_CHECKING:
    from butter.library import Model

log = logging.getLogger("butter.serve")


class Generation:
    """One chat request running on the engine, read as parsed deltas.

    Iterate it for :class:`~butter.chat.recovery.Delta` objects; afterwards
    ``finish_reason``, ``usage`` and ``tool_calls`` are set. ``cancel()`` stops the
    work at the next bounded work unit (safe to call at any time, more than once).
    """

    def __init__(self, backend: "ButterServeBackend", request: Request, channel: AsyncChannel,
                 reader: AnswerReader) -> None:
        self._backend = backend
        self._request = request
        self._channel = channel
        self._reader = reader
        self.id = request.id
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # which of the request's stop strings ended it
        self.usage: Usage | None = None
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
        reader = self._reader
        for delta in reader.start():
            yield delta
        while True:
            event = await self._channel.get()
            if isinstance(event, TextDelta):
                for delta in reader.feed(event.text):
                    yield delta
            elif isinstance(event, Finished):
                self._done = True
                for delta in reader.finish():
                    yield delta
                self.usage = event.usage
                self.stop_sequence = event.stop_sequence
                self.finish_reason = "tool_calls" if reader.tool_calls else event.reason
                return
            elif isinstance(event, Failed):
                self._done = True
                raise event.error

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._reader.tool_calls

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._backend.cancel(self._request)


@runtime_checkable
class ServeBackend(Protocol):
    """What ``butter.http`` needs: one resident model id and chat generations."""

    @property
    def model_id(self) -> str: ...

    @property
    def healthy(self) -> bool:
        """False once the engine has stopped on its own: ``/health`` answers 503."""

    def model_card(self) -> dict: ...

    async def generate(self, request: ChatRequest) -> Generation: ...

    async def count_tokens(self, request: ChatRequest) -> int: ...

    def metrics_text(self) -> str: ...

    async def aclose(self) -> None: ...


class ButterServeBackend:
    """Serves one loaded :class:`~butter.library.Model` with a bounded session pool."""

    def __init__(self, model: "Model", *, model_id: str | None = None,
                 maximum_concurrent_requests: int = 1, max_context: int | None = None,
                 prefill_chunk: int = 256, micro_batch: int | None = None,
                 enable_thinking: bool | None = None,
                 reasoning_effort: str | None = None) -> None:
        self.model = model
        self._model_id = model_id or model.model_id
        self.enable_thinking = enable_thinking
        self.reasoning_effort = reasoning_effort
        capacity = max_context or model.info.n_ctx_train
        self.engine = model.start_engine(EngineConfig(
            parallel=maximum_concurrent_requests, capacity=capacity, prefill_chunk=prefill_chunk,
            options={"micro_batch": micro_batch} if micro_batch else {},
        ))

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def healthy(self) -> bool:
        return not self.engine.died

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
                "path": str(self.model.resolved.path),
            },
        }

    def plan(self, request: ChatRequest) -> PromptPlan:
        return build_prompt(request, self.model.template, default_thinking=self.enable_thinking,
                            default_effort=self.reasoning_effort, guard=self.model.guard)

    def _prepare(self, request: ChatRequest) -> tuple[PromptPlan, list[int]]:
        plan = self.plan(request)
        return plan, self.model.encode(plan.text)

    async def generate(self, request: ChatRequest) -> Generation:
        # Rendering and tokenizing run on a worker thread: neither the event loop nor the
        # engine thread waits for a large prompt.
        plan, tokens = await asyncio.to_thread(self._prepare, request)
        reader = AnswerReader.for_plan(plan, tools=request.tools, formats=self.model.tool_formats)
        channel = AsyncChannel()
        engine_request = Request(tokens, request.params, channel)
        generation = Generation(self, engine_request, channel, reader)
        self.engine.submit(engine_request)
        try:
            await generation.admitted()
        except asyncio.CancelledError:
            self.cancel(engine_request)
            raise
        return generation

    async def count_tokens(self, request: ChatRequest) -> int:
        _, tokens = await asyncio.to_thread(self._prepare, request)
        return len(tokens)

    def cancel(self, request: Request) -> None:
        self.engine.cancel(request)

    def metrics_text(self) -> str:
        return self.engine.metrics.render(model_id=self.model_id, fused=self.engine.fused)

    def close(self, error: ButterError | None = None) -> None:
        self.model.close(error)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


class ResidentServeBackend:
    """One resident model, swapped when a request names another resolvable id.

    ``loader(model_id)`` returns a :class:`~butter.library.Model`. A swap aborts the
    old model's requests, frees it, then loads the new one; if that fails, the old
    one is loaded again and keeps serving. ``allow_swap=False`` answers 404 instead.
    """

    def __init__(self, loader: Callable[[str], "Model"], initial: str, *,
                 allow_swap: bool = True, resolve_key: Callable[[str], str] | None = None,
                 **backend_options) -> None:
        self._loader = loader
        self._options = backend_options
        self.allow_swap = allow_swap
        self._resolve_key = resolve_key or _default_key
        self._lock = asyncio.Lock()
        self._current = self._build(initial)
        self.swaps = 0

    def _build(self, model_id: str) -> ButterServeBackend:
        model = self._loader(model_id)
        try:
            return ButterServeBackend(model, model_id=model_id, **self._options)
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

    def metrics_text(self) -> str:
        return self._current.metrics_text()

    def _is_resident(self, model_id: str | None) -> bool:
        current = self._current
        if not model_id or model_id == current.model_id:
            return True
        key = self._resolve_key(model_id)
        return key is not None and key == str(current.model.resolved.path.resolve())

    async def backend_for(self, model_id: str | None) -> ButterServeBackend:
        if self._is_resident(model_id) and not self._lock.locked():
            return self._current
        async with self._lock:
            if not self._is_resident(model_id):
                if not self.allow_swap:
                    raise ModelNotFoundError(model_id, "This server does not swap models "
                                             "(--no-swap).")
                await self._swap(model_id)
            return self._current

    async def _swap(self, model_id: str) -> None:
        old = self._current
        log.info("swap requested: %s -> %s", old.model_id, model_id)
        await asyncio.to_thread(self._loader_precheck, model_id)
        aborted = RequestAbortedError(f"The resident model is being swapped to `{model_id}`.")
        await asyncio.to_thread(old.close, aborted)
        try:
            self._current = await asyncio.to_thread(self._build, model_id)
        except Exception as exc:
            log.warning("swap to %s failed (%s); reloading %s", model_id, exc, old.model_id)
            self._current = await asyncio.to_thread(self._build, old.model_id)
            if isinstance(exc, ButterError):
                raise
            raise InternalError(f"Loading `{model_id}` failed.") from exc
        self.swaps += 1
        log.info("swap done: now serving %s", model_id)

    def _loader_precheck(self, model_id: str) -> None:
        precheck = getattr(self._loader, "precheck", None)
        if precheck is not None:
            precheck(model_id)

    async def generate(self, request: ChatRequest) -> Generation:
        backend = await self.backend_for(request.model)
        return await backend.generate(request)

    async def count_tokens(self, request: ChatRequest) -> int:
        backend = await self.backend_for(request.model)
        return await backend.count_tokens(request)

    async def aclose(self) -> None:
        await self._current.aclose()


def _default_key(model_id: str) -> str | None:
    from butter.library import default_plugins

    try:
        return default_plugins().resolve(model_id).key
    except ButterError:
        return None
