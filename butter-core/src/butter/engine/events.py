"""The typed channel between the engine thread and whoever waits on a request.

The engine emits exactly: one :class:`Admitted` or one :class:`Failed` first, then
:class:`TextDelta` events, then one :class:`Finished` (or :class:`Failed`).
"""

from __future__ import annotations

import asyncio
import queue
from typing import Protocol

import attrs

from butter.errors import ButterError
from butter.generation import Logprob, Usage


@attrs.frozen
class Admitted:
    """The prompt was tokenized and can fit: the request is queued or running."""

    prompt_tokens: int


@attrs.frozen
class TextDelta:
    text: str
    # The log-probabilities of the tokens this text completes (when the request asked).
    logprobs: tuple[Logprob, ...] = ()


@attrs.frozen
class Finished:
    reason: str  # "stop", "length" or "cancelled"
    usage: Usage
    stop_sequence: str | None = None  # the client's stop string that ended it, if one did


@attrs.frozen
class Failed:
    error: ButterError


Event = Admitted | TextDelta | Finished | Failed


class Channel(Protocol):
    def emit(self, event: Event) -> None:
        """Deliver ``event``; called from the engine thread, must never block."""


class AsyncChannel:
    """Delivers events into an asyncio queue owned by one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def emit(self, event: Event) -> None:
        _call_in_loop(self._loop, self._queue.put_nowait, event)

    def put_nowait(self, event: Event) -> None:
        """Deliver from inside the channel's own loop."""
        self._queue.put_nowait(event)

    async def get(self) -> Event:
        return await self._queue.get()


def _call_in_loop(loop: asyncio.AbstractEventLoop, function, *args) -> None:
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _deliver(batch: list[tuple[AsyncChannel, Event]]) -> None:
    for channel, event in batch:
        channel.put_nowait(event)


class Outbox:
    """Events of one engine step, handed to each event loop in one wake-up.

    A step produces a token for every decoding session; waking the HTTP loop once per
    step instead of once per token leaves the cores to the model.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Channel, Event]] = []

    def put(self, channel: Channel, event: Event) -> None:
        self._pending.append((channel, event))

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncChannel, Event]]] = {}
        for channel, event in pending:
            if isinstance(channel, AsyncChannel):
                by_loop.setdefault(channel.loop, []).append((channel, event))
            else:
                channel.emit(event)
        for loop, batch in by_loop.items():
            _call_in_loop(loop, _deliver, batch)


class SyncChannel:
    """Delivers events to a plain thread (the in-process library API)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def emit(self, event: Event) -> None:
        self._queue.put(event)

    def get(self, timeout: float | None = None) -> Event:
        return self._queue.get(timeout=timeout)
