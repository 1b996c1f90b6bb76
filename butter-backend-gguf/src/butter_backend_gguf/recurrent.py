"""Snapshots of a hybrid or recurrent model's state, so a session can resume from a prefix.

llama.cpp keeps one recurrent state per sequence (Qwen3.5's Gated DeltaNet layers, Mamba),
updated in place by every token: unlike attention keys and values it cannot be cut back.
llama-server keeps "context checkpoints" of it (``--ctx-checkpoints``, 32 per slot in the
pinned source): copies taken with ``llama_state_seq_get_data_ext(...,
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)``, which writes only the recurrent part of a hybrid
memory. Restoring one with ``llama_state_seq_set_data_ext`` puts the state back as it was
after position ``p - 1``; attention keys and values past ``p`` are then dropped with
``llama_memory_seq_rm`` (the recurrent part allows a cut past its own position).

Here a session keeps snapshots at positions that are multiples of ``every``, taken while
its prompt is read, at most ``limit`` of them (when full, the one whose neighbours sit
closest goes, so old prefixes stay reachable with coarser spacing and the newest stays).
They live in host memory, charged to the session through ``KVFacts.snapshot_bytes``.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as ll

from butter.backend import snapshot_at_or_below

log = logging.getLogger("butter.gguf")

PARTIAL = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
SNAPSHOT_EVERY = 32  # positions between snapshots; prompt pieces end at its multiples
MAX_SNAPSHOTS = 8  # per session


class StateSnapshots:
    """Every session's recurrent-state snapshots, by position (engine thread only)."""

    def __init__(self, ctx, memory, n_sessions: int, *, every: int = SNAPSHOT_EVERY,
                 limit: int = MAX_SNAPSHOTS) -> None:
        self._ctx, self._memory = ctx, memory
        self.every, self.limit = every, limit
        self._held: list[list[tuple[int, ctypes.Array]]] = [[] for _ in range(n_sessions)]

    def measure(self, session: int) -> int:
        """Bytes one snapshot of ``session``'s state takes (it must hold some state)."""
        return int(ll.llama_state_seq_get_size_ext(self._ctx, session, PARTIAL))

    def copy(self, session: int) -> ctypes.Array:
        """``session``'s recurrent state now, as bytes."""
        size = self.measure(session)
        buf = (ctypes.c_uint8 * size)()
        written = ll.llama_state_seq_get_data_ext(self._ctx, buf, size, session, PARTIAL)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} state bytes")
        return buf

    def take(self, session: int, position: int) -> None:
        """Keep ``session``'s state, which has read ``position`` tokens."""
        points = self._held[session]
        if points and points[-1][0] >= position:
            del points[self._index_above(points, position - 1):]
        points.append((position, self.copy(session)))
        while len(points) > self.limit:
            # The newest stays; of the rest, the one whose neighbours are closest goes.
            gaps = [points[i + 1][0] - (points[i - 1][0] if i else 0)
                    for i in range(len(points) - 1)]
            del points[gaps.index(min(gaps))]

    def last_at_or_below(self, session: int, position: int) -> int:
        """The latest snapshot position not past ``position`` (0: none)."""
        return snapshot_at_or_below(self._held[session], position)

    def restore(self, session: int, position: int) -> bool:
        """Put ``session``'s state back to its snapshot at ``position`` and drop its
        attention keys and values from there on; False (nothing changed) if it has none."""
        return self.install(session, session, position)

    def install(self, source: int, target: int, position: int) -> bool:
        """Give ``target`` the recurrent state ``source`` kept at ``position`` and cut
        ``target``'s attention keys and values there; False if there is no such snapshot."""
        data = next((buf for at, buf in self._held[source] if at == position), None)
        if data is None:
            return False
        return self.put(target, data, position) and self.share(source, target, position)

    def share(self, source: int, target: int, position: int) -> bool:
        """Give ``target`` ``source``'s snapshots up to ``position`` (the bytes are shared:
        neither side writes into a snapshot)."""
        if source != target:
            self._held[target] = [p for p in self._held[source] if p[0] <= position]
        return True

    def put(self, session: int, data: ctypes.Array, position: int) -> bool:
        """Load ``data`` as ``session``'s recurrent state after ``position`` tokens and drop
        its attention keys and values from ``position`` on."""
        read = ll.llama_state_seq_set_data_ext(self._ctx, data, len(data), session, PARTIAL)
        if read != len(data):
            log.warning("llama.cpp refused a state snapshot (%d of %d bytes read)", read,
                        len(data))
            return False
        if not ll.llama_memory_seq_rm(self._memory, session, position, -1):
            return False
        self.forget(session, after=position)
        return True

    def held(self, session: int) -> tuple[tuple[int, ctypes.Array], ...]:
        """``session``'s snapshots, ``(position, bytes)`` (to keep beside a saved cache)."""
        return tuple(self._held[session])

    def adopt(self, session: int, points: tuple[tuple[int, ctypes.Array], ...]) -> None:
        """Make ``points`` (from :meth:`held`) ``session``'s snapshots."""
        self._held[session] = list(points)

    def forget(self, session: int, *, after: int = 0) -> None:
        """Drop ``session``'s snapshots past ``after`` (all of them by default)."""
        points = self._held[session]
        del points[self._index_above(points, after):]

    def count(self, session: int) -> int:
        return len(self._held[session])

    @staticmethod
    def _index_above(points: list[tuple[int, ctypes.Array]], position: int) -> int:
        for index, (at, _) in enumerate(points):
            if at > position:
                return index
        return len(points)
