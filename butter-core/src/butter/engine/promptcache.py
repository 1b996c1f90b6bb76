"""Prompts kept in host memory after their session moves on (``--cache-ram``).

A session keeps its cache only until another prompt takes it: with eight sessions, the
ninth conversation of an agent's rounds reads its whole prompt again. Before a session
drops most of what it holds (the next prompt keeps less than half of it, llama-server's
rule for its own ``--cache-ram``), the engine copies that cache to host memory with
``Runtime.save``; a later prompt that starts with one of the saved ones loads it back
with ``Runtime.restore`` and reads only the rest. Entries go least recently used first
once their bytes pass the budget; an entry that another one extends is dropped, and a
cache that a saved entry already extends is not saved again.

Only the engine thread touches it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import attrs

from butter.engine.admission import common_prefix

DEFAULT_MIB = 8192  # llama-server's --cache-ram default
# Tokens a load must add to what the session holds: a match of a template's first
# tokens is not worth a whole entry's copy.
MIN_GAIN = 16
MIB = 1 << 20


@attrs.define(slots=True)
class Saved:
    """One session's cache in host memory: the tokens it holds and the runtime's bytes."""

    tokens: tuple[int, ...]
    data: object
    size: int


@attrs.define
class PromptCache:
    budget: int  # bytes
    _entries: collections.OrderedDict[int, Saved] = attrs.field(
        factory=collections.OrderedDict)  # oldest use first
    _ids: int = 0
    bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether a saved entry holds ``tokens`` (all of them, as its prefix)."""
        n = len(tokens)
        return any(len(e.tokens) >= n and common_prefix(e.tokens, tokens) == n
                   for e in self._entries.values())

    def keep(self, tokens: Sequence[int], data: object, size: int) -> None:
        """Save a session's cache of ``tokens``; entries it extends go, and the oldest
        while the budget is passed."""
        if size > self.budget:
            return
        tokens = tuple(tokens)
        for key, entry in list(self._entries.items()):
            if common_prefix(entry.tokens, tokens) == len(entry.tokens):
                self._drop(key)
        self._ids += 1
        self._entries[self._ids] = Saved(tokens, data, size)
        self.bytes += size
        while self.bytes > self.budget:
            self._drop(next(iter(self._entries)))

    def best(self, prompt: Sequence[int], better_than: int,
             reach: Callable[[object, int], int] = lambda data, keep: keep,
             ) -> tuple[Saved | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (one prompt token left to
        read) that a load can be cut back to (``reach(data, shared)``: recurrent state only
        where a snapshot was kept), if that beats ``better_than``; it becomes the most
        recently used."""
        best_key, best_shared = None, better_than
        for key, entry in self._entries.items():
            shared = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if shared > best_shared:
                shared = reach(entry.data, shared)
            if shared > best_shared:
                best_key, best_shared = key, shared
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        return self._entries[best_key], best_shared

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).size
