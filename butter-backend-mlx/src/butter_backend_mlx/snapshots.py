"""Snapshots of a hybrid model's recurrent state for the MLX runtime.

mlx-lm keeps a hybrid's recurrent layers (Qwen3.5's Gated DeltaNet: a convolution window
and a state matrix per sequence) in an ``ArraysCache`` and its attention layers in a
``KVCache``. Attention trims back; the recurrent state does not. So, as the GGUF back end
does with llama.cpp's state API, a session keeps snapshots of its ``ArraysCache`` arrays
at positions that are multiples of ``every`` (the CPU prefill step, so at chunk ends) and
a few tokens before a prompt's end, at most ``limit`` of them. MLX arrays are values: a
snapshot holds new references to them (``mx.array(a)``), not copies of their bytes, and a
later in-place write to the session's cache does not reach it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from butter.backend import snapshot_at_or_below

SNAPSHOT_EVERY = 32
MAX_SNAPSHOTS = 8
TAIL_SNAPSHOT = 4  # a snapshot this many tokens before a prompt's end (llama-server's 4)

# One snapshot: per layer, the ArraysCache arrays (None for an attention layer).
State = list[list[mx.array | None] | None]


def recurrent(caches: list) -> bool:
    """Whether a session's per-layer caches hold recurrent state."""
    return any(isinstance(c, ArraysCache) for c in caches)


def capture(caches: list) -> State:
    """The recurrent state of one session's caches now."""
    return [[None if a is None else mx.array(a) for a in c.cache]
            if isinstance(c, ArraysCache) else None for c in caches]


def state_bytes(state: State) -> int:
    return sum(a.nbytes for layer in state if layer for a in layer if a is not None)


class Snapshots:
    """Every session's recurrent-state snapshots, by position (engine thread only)."""

    def __init__(self, n_sessions: int, *, every: int = SNAPSHOT_EVERY,
                 limit: int = MAX_SNAPSHOTS) -> None:
        self.every, self.limit = every, limit
        self._held: list[list[tuple[int, State]]] = [[] for _ in range(n_sessions)]

    def take(self, session: int, position: int, caches: list) -> None:
        points = self._held[session]
        self.forget(session, after=position - 1)
        points.append((position, capture(caches)))
        while len(points) > self.limit:
            # The newest stays; of the rest, the one whose neighbours are closest goes.
            gaps = [points[i + 1][0] - (points[i - 1][0] if i else 0)
                    for i in range(len(points) - 1)]
            del points[gaps.index(min(gaps))]

    def last_at_or_below(self, session: int, position: int) -> int:
        return snapshot_at_or_below(self._held[session], position)

    def get(self, session: int, position: int) -> State | None:
        return next((state for at, state in self._held[session] if at == position), None)

    def share(self, source: int, target: int, position: int) -> None:
        if source != target:
            self._held[target][:] = [p for p in self._held[source] if p[0] <= position]

    def held(self, session: int) -> tuple[tuple[int, State], ...]:
        """``session``'s snapshots, ``(position, state)`` (to keep beside a saved cache)."""
        return tuple(self._held[session])

    def adopt(self, session: int, points: tuple[tuple[int, State], ...]) -> None:
        """Make ``points`` (from :meth:`held`) ``session``'s snapshots."""
        self._held[session][:] = list(points)

    def forget(self, session: int, *, after: int = 0) -> None:
        self._held[session][:] = [p for p in self._held[session] if p[0] <= after]

    def tail(self, end: int) -> int:
        """Where a prompt ending at ``end`` gets its tail snapshot."""
        return max(end - TAIL_SNAPSHOT, 0)


def restored(caches: list, state: State, length: int, keep: int, prefix) -> list:
    """``caches`` (holding ``length`` positions) cut back to ``keep``: recurrent layers
    from ``state`` (taken at ``keep``), attention layers through ``prefix(cache, keep)``
    (a copy) or trimmed in place when ``prefix`` is None."""
    out = []
    for cache, layer in zip(caches, state):
        if isinstance(cache, ArraysCache):
            fresh = ArraysCache(len(cache.cache))
            fresh.cache = list(layer)
            out.append(fresh)
        elif prefix is not None:
            out.append(prefix(cache, keep))
        else:
            cache.trim(length - keep)
            out.append(cache)
    return out
