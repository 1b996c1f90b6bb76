"""Admission: what a request may reserve, which session it leases, what gets evicted.

Accounting, in KV cells of the one shared cache (``capacity``):

- an active request reserves ``prompt + max_tokens`` cells (its reused prefix
  included: those cells are already held by its session, so they cost nothing new);
- an idle session holds ``len(session.tokens)`` cells until it is evicted;
- a prefix copied from another session shares that session's cells (no new cell is
  taken), but it is counted for both: the accounting errs on the safe side;
- a request is installed only when active reservations + its own + the cells of
  the idle sessions that stay cached fit in ``capacity``. Idle caches are evicted
  least recently used first; if even that is not enough, the request waits.

Default completion budget when the client sends no ``max_tokens``: the request's
share of the cache (``capacity // parallel``, as llama-server splits its context
into slots) minus the prompt, but at least ``DEFAULT_MIN_COMPLETION`` tokens, and
never more than what the cache can hold next to the prompt.
"""

from __future__ import annotations

from typing import Sequence

from butter.engine.records import Request, Session
from butter.errors import ContextLengthExceededError

DEFAULT_MIN_COMPLETION = 512


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Admission:
    def __init__(self, capacity: int, parallel: int) -> None:
        self.capacity = capacity
        self.parallel = parallel

    def plan(self, request: Request) -> int:
        """The request's completion budget; raise if it can never fit."""
        prompt = len(request.prompt_tokens)
        asked = request.params.max_tokens
        if asked is not None:
            if prompt + asked > self.capacity:
                raise ContextLengthExceededError(
                    prompt_tokens=prompt, requested_tokens=asked, context_window=self.capacity
                )
            return asked
        room = self.capacity - prompt
        if room < 1:
            raise ContextLengthExceededError(
                prompt_tokens=prompt, requested_tokens=1, context_window=self.capacity
            )
        share = self.capacity // self.parallel - prompt
        return min(room, max(share, DEFAULT_MIN_COMPLETION))

    @staticmethod
    def pick_session(
        idle: Sequence[Session], prompt: Sequence[int], *, can_rewind: bool
    ) -> tuple[Session | None, int]:
        """The idle session with the longest reusable prefix (then least recently used).

        At least one prompt token is always left to prefill, so the last position
        produces fresh logits. A session that cannot rewind is reusable only when
        its whole cache is a prefix of the prompt.
        """
        best: Session | None = None
        best_reuse = -1
        for session in sorted(idle, key=lambda s: s.last_used):
            shared = common_prefix(session.tokens, prompt)
            if not can_rewind and shared < len(session.tokens):
                shared = 0
            reuse = min(shared, len(prompt) - 1)
            if not can_rewind and reuse < len(session.tokens):
                reuse = 0
            if reuse > best_reuse:
                best, best_reuse = session, reuse
        return best, max(best_reuse, 0)

    @staticmethod
    def best_source(
        sessions: Sequence[Session], prompt: Sequence[int], *, better_than: int
    ) -> tuple[Session | None, int]:
        """The session, idle or busy, holding the longest prefix of ``prompt``.

        Returns (None, 0) unless it beats ``better_than`` (what the leased session
        already holds). Like :meth:`pick_session`, leaves one prompt token to prefill.
        """
        best: Session | None = None
        best_shared = better_than
        for session in sessions:
            shared = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
            if shared > best_shared:
                best, best_shared = session, shared
        return (best, best_shared) if best is not None else (None, 0)

    def make_room(
        self,
        request: Request,
        session: Session | None,
        active: Sequence[Request],
        idle: Sequence[Session],
    ) -> list[Session] | None:
        """Idle sessions to evict so ``request`` fits, or None if it must wait."""
        if session is None:
            return None
        reserved = sum(r.reservation for r in active) + request.reservation
        others = sorted((s for s in idle if s is not session and s.tokens), key=lambda s: s.last_used)
        held = sum(len(s.tokens) for s in others)
        evict: list[Session] = []
        for victim in others:
            if reserved + held <= self.capacity:
                break
            evict.append(victim)
            held -= len(victim.tokens)
        if reserved + held > self.capacity:
            return None
        return evict
