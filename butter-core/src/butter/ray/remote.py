"""Both ends of a generation that crosses a Ray Serve ``DeploymentHandle``.

A replica runs butter's own :class:`~butter.serving.ResidentServeBackend` and streams a
request as records: :class:`Started` once the engine admitted the prompt, then the
parsed deltas, then :class:`Finished` (or :class:`Failure`, a ``ButterError`` as data).
The ingress wraps that stream in :class:`RemoteGeneration`, which quacks like
:class:`~butter.serving.Generation`, behind :class:`RemoteBackend` (one
:class:`Deployment` per model), which quacks like a :class:`~butter.serving.ServeBackend`:
the litestar app of ``butter serve`` (:func:`butter.http.app.create_app`) serves it
unchanged, every route and error with it.

Cancelling a :class:`RemoteGeneration` cancels the handle call; Ray cancels the
replica's task, whose ``finally`` cancels the engine request at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from butter.chat.recovery import Delta, ToolCall
from butter.chat.request import ChatRequest
from butter.errors import ButterError, ForwardedError, InternalError, ReplicaLostError
from butter.generation import Usage
from butter.serving import ServeBackend

if TYPE_CHECKING:
    from butter.ray.metrics import ModelReport

log = logging.getLogger("butter.ray")

# A targeted call (stats, one replica's card) gives up after this long: a replica being
# replaced must not hang /metrics.
TARGETED_TIMEOUT = 10.0


@attrs.frozen
class Started:
    prompt_tokens: int
    replica: str
    model: str  # the id the replica serves its model as


@attrs.frozen
class Finished:
    finish_reason: str | None
    stop_sequence: str | None
    usage: Usage | None
    tool_calls: list[ToolCall]


@attrs.frozen
class Failure:
    """A :class:`ButterError` as plain data (its subclasses' constructors differ)."""

    message: str
    status_code: int
    error_type: str
    code: str | None
    param: str | None

    @classmethod
    def of(cls, error: ButterError) -> Failure:
        return cls(error.message, error.status_code, error.error_type, error.code, error.param)

    def error(self) -> ForwardedError:
        return ForwardedError(self.message, status_code=self.status_code,
                              error_type=self.error_type, code=self.code, param=self.param)


async def stream_generation(backend: ServeBackend, request: ChatRequest,
                            replica: str) -> AsyncIterator[Any]:
    """The replica's side: ``request`` on ``backend``, as records (see the module)."""
    try:
        generation = await backend.generate(request)
    except ButterError as error:
        yield Failure.of(error)
        return
    try:
        yield Started(generation.prompt_tokens, replica, generation.model)
        async for delta in generation:
            yield delta
        yield Finished(generation.finish_reason, generation.stop_sequence, generation.usage,
                       list(generation.tool_calls))
    except ButterError as error:
        yield Failure.of(error)
    except Exception:  # never a traceback on the wire; the replica logs it
        log.exception("generation failed on replica %s", replica)
        yield Failure.of(InternalError())
    finally:
        # A hang-up reaches here as Ray's cancellation of this task.
        generation.cancel()


def replica_stats(backend: Any, replica: str) -> dict[str, Any]:
    """What a replica reports of itself: load for the router, counters for /metrics."""
    engine = backend.current.engine
    metrics = engine.metrics
    gauges = metrics.gauges  # once: all of one engine iteration
    # Free KV is the shared budget's, in bytes: ``kv_capacity_cells`` is what one
    # sequence may hold (the per-session context), not what every session shares.
    budget = metrics.kv_budget_bytes or 1
    return {
        "replica": replica,
        "pid": os.getpid(),
        "healthy": backend.healthy,
        "queue": gauges.active_requests + gauges.queued_requests,
        "active": gauges.active_requests,
        "queued": gauges.queued_requests,
        "sessions_busy": gauges.sessions_busy,
        "free_kv": max(0.0, 1.0 - gauges.kv_reserved_bytes / budget),
        "requests": metrics.requests_total,
        "prompt_tokens": metrics.prompt_tokens,
        "cached_tokens": metrics.cached_tokens,
        "generated_tokens": metrics.generated_tokens,
        "exposition": backend.metrics_text(),
    }


@contextlib.contextmanager
def own_request_id() -> Iterator[str]:
    """Give the handle call made inside a request id of its own.

    Serve hands every call made while serving one HTTP request that request's internal
    id, and its router indexes pending calls by it: two calls in flight from one request
    (``n`` choices, /metrics asking each replica) would collide and one would never be
    dispatched. Each call here is its own request to the replicas.
    """
    from ray.serve import context
    from ray.serve._private.utils import generate_request_id

    current = context._get_serve_request_context()
    request_id = generate_request_id()
    token = context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=request_id))
    try:
        yield request_id
    finally:
        context._serve_request_context.reset(token)


def _lost(exc: BaseException) -> ReplicaLostError:
    log.warning("replica call failed: %s", type(exc).__name__)
    return ReplicaLostError(f"The replica serving this request was lost "
                            f"({type(exc).__name__}); Ray Serve replaces it.")


class RemoteGeneration:
    """A generation running on a replica, read through a streaming handle call."""

    def __init__(self, stream: Any, on_end: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self._on_end = on_end  # tells the router the stream no longer loads its replica
        self.id = ""
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.replica = ""
        self.model = ""
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self.tool_calls: list[ToolCall] = []
        self._done = False

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    async def _next(self) -> Any:
        import ray.exceptions

        try:
            item = await self._stream.__anext__()
        except StopAsyncIteration:
            self._ended()
            raise _lost(StopAsyncIteration()) from None
        except (ray.exceptions.RayError, ConnectionError) as exc:
            self._ended()
            raise _lost(exc) from None
        except asyncio.CancelledError as exc:
            # Serve turns a task cancelled on the replica's side (its actor died under
            # it) into CancelledError here. Only a cancel of this task is ours to pass
            # on; any other means the replica is gone, and the stream ends with an error
            # event, not a cut connection.
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            self._ended()
            raise _lost(exc) from None
        if isinstance(item, Finished | Failure):
            self._ended()
        return item

    async def admitted(self) -> None:
        try:
            first = await self._next()
        except BaseException:
            self.cancel()
            raise
        if isinstance(first, Failure):
            self._done = True
            raise first.error()
        self.prompt_tokens = first.prompt_tokens
        self.replica = first.replica
        self.model = first.model

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while True:
                item = await self._next()
                if isinstance(item, Finished):
                    self.finish_reason, self.stop_sequence = item.finish_reason, \
                        item.stop_sequence
                    self.usage, self.tool_calls = item.usage, item.tool_calls
                    self._done = True
                    return
                if isinstance(item, Failure):
                    self._done = True
                    raise item.error()
                yield item
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._stream.cancel()
        self._ended()


class Deployment:
    """One model's replica deployment, as the ingress calls it.

    ``handle`` is its deployment handle; ``card`` the model card one replica gave. Its
    router (a :class:`~butter.ray.router.PrefixAffinityRouter`, living in this process
    once the handle routed a call) names the replicas for /metrics and /health.
    """

    def __init__(self, handle: Any, card: dict) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self.card = card
        self.name = handle.deployment_name

    @property
    def model_id(self) -> str:
        return self.card["id"]

    def router(self) -> Any:
        from butter.ray.registry import router_for

        return router_for(self.name)

    @property
    def healthy(self) -> bool:
        """Routable: its router lists a replica (or has not started yet)."""
        router = self.router()
        return router is None or bool(router.replica_ids)

    def model_card(self) -> dict:
        router = self.router()
        replicas = len(router.replica_ids) if router is not None else None
        return {**self.card, "butter": {**self.card["butter"], "replicas": replicas}}

    async def generate(self, request: ChatRequest) -> RemoteGeneration:
        with own_request_id() as request_id:
            call = self._stream_handle.generate.remote(request)
        generation = RemoteGeneration(call, functools.partial(self._release, request_id))
        await generation.admitted()
        return generation

    def _release(self, request_id: str) -> None:
        router = self.router()
        if router is not None and hasattr(router, "release"):
            # The router lives on Serve's router thread: its state changes there only.
            router._event_loop.call_soon_threadsafe(router.release, request_id)

    async def count_tokens(self, request: ChatRequest) -> int:
        import ray.exceptions

        with own_request_id():
            call = self._handle.count_tokens.remote(request)
        try:
            result = await call
        except (ray.exceptions.RayError, ConnectionError) as exc:
            raise _lost(exc) from None
        if isinstance(result, Failure):
            raise result.error()
        return result

    async def replica_stats(self) -> list[dict[str, Any]]:
        """Every replica's :func:`replica_stats`, each asked by id (none that fail)."""
        from butter.ray.router import TARGET

        router = self.router()
        if router is None:
            return []

        async def ask(replica: str) -> dict[str, Any] | None:
            with own_request_id():
                call = self._handle.stats.remote(**{TARGET: replica})
            try:
                return await asyncio.wait_for(call, TARGETED_TIMEOUT)
            except Exception as exc:
                call.cancel()
                log.warning("replica %s did not report: %s", replica, type(exc).__name__)
                return None

        wanted = router.replica_ids
        found: dict[str, dict[str, Any]] = {}
        for _ in range(3):  # a router whose FIFO may hand an aimed call elsewhere: retry
            answers = await asyncio.gather(*(ask(r) for r in wanted if r not in found))
            found.update((a["replica"], a) for a in answers if a is not None)
            if all(r in found for r in wanted):
                break
        return [found[r] for r in wanted if r in found]

    async def report(self) -> ModelReport:
        """What /metrics shows of this model: its replicas' stats and its router's."""
        from butter.ray.metrics import ModelReport

        router = self.router()
        return ModelReport(
            model_id=self.model_id, stats=await self.replica_stats(),
            decisions=dict(router.decisions) if router is not None else {},
            inflight=dict(getattr(router, "inflight", {})) if router is not None else {})


class RemoteBackend:
    """A :class:`~butter.serving.ServeBackend` whose engines are Ray Serve replicas: one
    :class:`Deployment` per model, the first answering requests that name no model.

    A request goes to the deployment serving its ``model``. Any other name goes to the
    first deployment, whose replicas resolve it as one ``butter serve --no-swap`` does:
    another name of that checkpoint is served, anything else is the same 404.
    """

    def __init__(self, deployments: list[Deployment]) -> None:
        self._deployments = deployments
        self._by_id = {deployment.model_id: deployment for deployment in deployments}

    def deployment(self, model: str | None) -> Deployment:
        return self._by_id.get(model or "", self._deployments[0])

    @property
    def model_id(self) -> str:
        return self._deployments[0].model_id

    @property
    def healthy(self) -> bool:
        """Every model has a routable replica."""
        return all(deployment.healthy for deployment in self._deployments)

    def model_card(self) -> dict:
        return self._deployments[0].model_card()

    def model_cards(self) -> list[dict]:
        return [deployment.model_card() for deployment in self._deployments]

    async def generate(self, request: ChatRequest) -> RemoteGeneration:
        return await self.deployment(request.model).generate(request)

    async def count_tokens(self, request: ChatRequest) -> int:
        return await self.deployment(request.model).count_tokens(request)

    async def metrics_text(self) -> str:
        from butter.ray.metrics import cluster_exposition

        return cluster_exposition(
            await asyncio.gather(*(d.report() for d in self._deployments)))

    async def aclose(self) -> None:
        return None
