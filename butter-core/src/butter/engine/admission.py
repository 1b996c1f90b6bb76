"""Admission: what a request may reserve, which session it leases, what gets evicted.

Accounting is in the runtime's KV bytes (:class:`~butter.backend.KVFacts`), so a
quantized or windowed cache admits more, and a copied fork costs what it copies:

- an active request reserves ``kv.cost(prompt + max_tokens)`` (its reused prefix
  included: those tokens are already held by its session, so they cost nothing new);
- an idle session holds ``kv.cost(len(session.tokens))`` until it is evicted;
- a prefix taken from another session is counted for both holders, whether the
  runtime aliases it or copies it: the accounting errs on the safe side;
- a request is installed only when active reservations + its own + what the idle
  sessions that stay cached hold fit in ``kv.budget_bytes``. Idle caches are evicted
  least recently used first; if even that is not enough, the request waits.

With a KV window the prompt must fit the window and the answer may run past it (the
runtime drops old positions); a session whose window shifted is never reused or forked.
Recurrent state (hybrid models) is reused up to the last snapshot the runtime kept
inside the shared prefix (``Runtime.reachable``); ``kv.cost`` counts the snapshots.

Default completion budget when the client sends no ``max_tokens``: the request's
share of the cache (``capacity // parallel``, as llama-server splits its context
into slots) minus the prompt, but at least ``DEFAULT_MIN_COMPLETION`` tokens, and
never more than what one session can hold next to the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from butter.backend import KVFacts, PromptTail
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
    def __init__(self, kv: KVFacts, parallel: int,
                 reachable: Callable[[int, int, PromptTail | None], int] | None = None,
                 ) -> None:
        self.kv = kv
        self.parallel = parallel
        # The runtime's ``reachable(seq_id, keep, tail)``: where a snapshot lets it cut,
        # and how far its cache was read as a prompt with this tail reads it.
        self._reachable = reachable

    def reachable(self, session: Session, keep: int, tail: PromptTail | None = None) -> int:
        """The longest prefix of at most ``keep`` of ``session``'s tokens it can be cut
        back to (or forked at) for a prompt ending in ``tail``; 0 if none."""
        length = len(session.tokens)
        if self.kv.wrapped(length):
            return 0
        keep = min(keep, length)
        if self._reachable is not None:
            return self._reachable(session.seq_id, keep, tail)
        return keep if self.kv.can_truncate(length, keep) else 0

    @property
    def capacity(self) -> int:
        """The longest prompt + completion one request may ask for, in tokens."""
        return self.kv.capacity

    def plan(self, request: Request) -> int:
        """The request's completion budget; raise if it can never fit."""
        prompt = len(request.prompt_tokens)
        asked = request.params.max_tokens
        capacity = self.capacity
        if self.kv.window is not None:  # the prompt fits the window; the answer runs past it
            if prompt > capacity:
                raise ContextLengthExceededError(
                    prompt_tokens=prompt, requested_tokens=asked or 1, context_window=capacity)
            return asked if asked is not None else \
                max(capacity // self.parallel - prompt, DEFAULT_MIN_COMPLETION)
        if asked is not None:
            if prompt + asked > capacity:
                raise ContextLengthExceededError(
                    prompt_tokens=prompt, requested_tokens=asked, context_window=capacity
                )
            return asked
        room = capacity - prompt
        if room < 1:
            raise ContextLengthExceededError(
                prompt_tokens=prompt, requested_tokens=1, context_window=capacity
            )
        share = capacity // self.parallel - prompt
        return min(room, max(share, DEFAULT_MIN_COMPLETION))

    def pick_session(
        self, idle: Sequence[Session], prompt: Sequence[int], tail: PromptTail | None = None
    ) -> tuple[Session | None, int]:
        """The idle session with the longest reusable prefix (then least recently used;
        with a KV stream per session, the lowest: busy sessions then sit side by side,
        and llama.cpp batches the rows of consecutive streams only).

        At least one prompt token is always left to prefill, so the last position
        produces fresh logits. A cache that cannot be cut where the prompt departs
        from it (a wrapped window) is reusable only whole; recurrent state back to its
        last snapshot inside the shared prefix.
        """
        best: Session | None = None
        best_reuse = -1
        order = (lambda s: s.seq_id) if self.kv.per_session else (lambda s: s.last_used)
        for session in sorted(idle, key=order):
            reuse = self.reachable(
                session, min(common_prefix(session.tokens, prompt), len(prompt) - 1), tail)
            if reuse > best_reuse:
                best, best_reuse = session, reuse
        return best, max(best_reuse, 0)

    def best_source(
        self, sessions: Sequence[Session], prompt: Sequence[int], *, better_than: int,
        tail: PromptTail | None = None,
    ) -> tuple[Session | None, int]:
        """The session, idle or busy, holding the longest prefix of ``prompt``.

        Returns (None, 0) unless it beats ``better_than`` (what the leased session
        already holds). Like :meth:`pick_session`, leaves one prompt token to prefill;
        a session whose window shifted holds no prefix to give, recurrent state only
        what a snapshot (or its whole length) holds.
        """
        best: Session | None = None
        best_shared = better_than
        for session in sessions:
            if self.kv.wrapped(len(session.tokens)):
                continue
            shared = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
            if shared > best_shared:
                shared = self.reachable(session, shared, tail)
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
        if self.kv.per_session:  # the session's own cells hold it (``plan`` checked)
            return []
        cost, budget = self.kv.cost, self.kv.budget_bytes
        reserved = sum(cost(r.reservation) for r in active) + cost(request.reservation)
        others = sorted((s for s in idle if s is not session and s.tokens),
                        key=lambda s: s.last_used)
        held = sum(cost(len(s.tokens)) for s in others)
        evict: list[Session] = []
        for victim in others:
            if reserved + held <= budget:
                break
            evict.append(victim)
            held -= cost(len(victim.tokens))
        if reserved + held > budget:
            return None
        return evict
