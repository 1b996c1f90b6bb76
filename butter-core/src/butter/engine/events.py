"""The typed channel between the engine thread and whoever waits on a request.

The engine emits exactly: one :class:`Admitted` or one :class:`Failed` first, then
:class:`TextDelta` events, then one :class:`Finished` (or :class:`Failed`).
"""

from __future__ import annotations

import asyncio
import queue
from typing import Protocol, Union

import attrs

from butter.errors import ButterError


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Admitted:
    """The prompt was tokenized and can fit: the request is queued or running."""

    prompt_tokens: int


@attrs.frozen
class TextDelta:
    text: str


@attrs.frozen
class Finished:
    reason: str  # "stop", "length" or "cancelled"
    usage: Usage
    stop_sequence: str | None = None  # the client's stop string that ended it, if one did


@attrs.frozen
class Failed:
    error: ButterError


Event = Union[Admitted, TextDelta, Finished, Failed]


class Channel(Protocol):
    def emit(self, event: Event) -> None:
        """Deliver ``event``; called from the engine thread, must never block."""


class AsyncChannel:
    """Delivers events into an asyncio queue owned by one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def emit(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> Event:
        return await self._queue.get()


class SyncChannel:
    """Delivers events to a plain thread (the in-process library API)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def emit(self, event: Event) -> None:
        self._queue.put(event)

    def get(self, timeout: float | None = None) -> Event:
        return self._queue.get(timeout=timeout)
