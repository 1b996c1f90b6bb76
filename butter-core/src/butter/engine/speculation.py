"""Prompt-lookup drafts: the tokens that followed the last time the context said this.

An answer that quotes its prompt (a paragraph to repeat, a file to return with one
change, a tool result to cite) repeats n-grams of its own context. :class:`Drafter`
keeps, per request, where each n-gram of the prompt and the output last ended, and
proposes the tokens that followed its most recent earlier occurrence. The runtime
verifies them in the request's next step (``Work.draft``): a draft is only a guess at
what plain decoding will draw, so the answer is the same with or without it.

A request drafts only when a match exists, and stops drafting while its drafts keep
failing: each verify that accepts nothing doubles the number of tokens it then decodes
plainly before it looks again (from 1 up to ``MAX_PAUSE``); a verify that accepts
something clears the pause.

How many tokens it drafts follows what a drafted row is worth. A verify row costs about
what one more decode row costs (``ROW_COST``: on SmolLM2 on a CPU a pass is roughly a
fixed part plus one as large per row), so the i-th draft pays only while the chance
that it and every draft before it are accepted, ``p ** i``, beats ``worth(lanes)``:
one half alone, 8/9 beside seven other decoding requests, whose fixed cost is already
shared. ``p`` is the request's own per-token acceptance, counted over its recent verifies.

Alone, the verify pass is the step's only pass. Beside other decoding requests it is a
pass of its own (a stream's rows share a micro-batch with another stream's only in equal
numbers), so a draft there must also pay for that pass's fixed part: its expected
accepted tokens must beat ``worth(lanes)`` times its rows plus ``ROW_COST``. Measured on
the plain workload at 4 and 8 lanes, drafting without that term cost 15-27% against
none; with it, such a request drafts only near-certain quotes.
"""

from __future__ import annotations

import attrs

NGRAM = 3  # tokens that must match (llama-server's ngram-simple looks at as few)
MIN_NGRAM = 2  # a shorter match is tried when the longest finds nothing
MAX_DRAFT = 12  # drafted tokens per verify at most
MAX_PAUSE = 64  # plain tokens after failed verifies, at most
ROW_COST = 1.0  # a pass's fixed cost over one row's cost (both measured per pass)
DECAY = 0.8  # the weight the acceptance count keeps per verify
PRIOR = (8.0, 1.0)  # accepted and rejected tokens assumed before the first verify


def worth(lanes: int) -> float:
    """The acceptance chance above which one more drafted row pays, with ``lanes``
    requests decoding together (they share each pass's fixed cost)."""
    return lanes / (lanes + ROW_COST)


@attrs.define(slots=True)
class Drafter:
    """One request's n-gram index over its prompt and output, and its acceptance."""

    max_draft: int = MAX_DRAFT
    _history: list[int] = attrs.field(factory=list)
    _ends: dict[tuple[int, ...], int] = attrs.field(factory=dict)  # n-gram -> end index
    _pause: int = 0  # plain tokens to decode before drafting again
    _penalty: int = 1  # the next pause after a verify that accepted nothing
    drafted: int = 0
    accepted: int = 0
    _hits: float = 0.0  # accepted tokens, decayed per verify
    _misses: float = 0.0  # verifies that rejected a token, decayed likewise

    def extend(self, tokens: list[int]) -> None:
        """Add the context's next tokens (the prompt, then each drawn token)."""
        history, ends = self._history, self._ends
        for token in tokens:
            # The n-grams ending here are followed by ``token``: index them now. The
            # context's last n-gram is indexed only once a token follows it, so a lookup
            # never finds itself.
            end = len(history)
            for n in range(MIN_NGRAM, NGRAM + 1):
                if end >= n:
                    ends[tuple(history[end - n:end])] = end
            history.append(token)
            if self._pause:
                self._pause -= 1

    @property
    def paused(self) -> bool:
        """Whether failed verifies keep this request decoding plainly for now."""
        return self._pause > 0

    @property
    def acceptance(self) -> float:
        """The chance that a drafted token is accepted, given the one before it was."""
        hits, misses = self._hits + PRIOR[0], self._misses + PRIOR[1]
        return hits / (hits + misses)

    def length(self, lanes: int) -> int:
        """How many drafted tokens pay with ``lanes`` requests decoding: alone at least
        one (so a request keeps learning its acceptance); beside others none unless the
        draft also pays for the verify pass it adds."""
        p, floor = self.acceptance, worth(lanes)
        count, chance, expected = 0, p, 0.0
        while chance > floor and count < self.max_draft:
            count += 1
            expected += chance
            chance *= p
        if lanes <= 1:
            return max(count, 1)
        return count if expected > floor * (count + ROW_COST) else 0

    def propose(self, limit: int, lanes: int = 1) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the latest earlier match of the context's
        last n-gram (the longest n that matches), as many as pay with ``lanes``
        requests decoding; or none."""
        limit = min(limit, self.max_draft, self.length(lanes))
        history = self._history
        if limit <= 0 or self._pause or len(history) < MIN_NGRAM + 1:
            return ()
        for n in range(NGRAM, MIN_NGRAM - 1, -1):
            end = self._ends.get(tuple(history[-n:]))
            if end is not None:
                return tuple(history[end:end + limit])
        return ()

    def verified(self, drafted: int, accepted: int) -> None:
        """Record a verify: ``accepted`` of ``drafted`` tokens were what plain decoding drew."""
        self.drafted += drafted
        self.accepted += accepted
        self._hits = self._hits * DECAY + accepted
        self._misses = self._misses * DECAY + (accepted < drafted)
        if accepted:
            self._penalty = 1
        else:
            self._pause = self._penalty
            self._penalty = min(self._penalty * 2, MAX_PAUSE)
