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

How many tokens it drafts follows what a pass costs: a fixed part plus a part per row.
A verify of ``k`` drafts is a pass of ``k + 1`` rows (the last token, then the drafts)
that yields ``E = 1 + p + ... + p ** k`` tokens on average, ``p`` the request's own
per-token acceptance, counted over its recent verifies. The request drafts the ``k``
that yields the most tokens per unit of cost, and only while that beats plain decoding
(alone: a token per pass, the fixed part taken as one row, ``ROW_COST``; beside other
lanes: below), ``k`` at most the tokens the match offers: a draft cut short by the
end of the context (an answer looping over three tokens offers three) must pay at its
own length. So a draft is as long as a sure quote pays for (one wrong guess wastes
every row after it) and none at all where the drafts keep failing: the acceptance
counts decay per verify, the prior's too, so a request whose drafts fail stops
drafting. It does not stop for good: while a match exists but drafting does not pay,
the drafter watches whether plain decoding draws the first ``SHADOW`` tokens it would
have drafted, and counts that as a verify it got for free. An answer that starts in its
own words and then quotes drafts again.

Alone, the verify pass is the step's only pass. Beside other decoding requests it is a
pass of its own (a stream's rows share a micro-batch with another stream's only in equal
numbers), and the pass everyone shares loses the request's row: the verify adds a pass's
fixed cost and ``k`` rows for ``E - 1`` more tokens, and must beat the shared pass's
tokens per cost. There the fixed part is the one measured for passes of two rows or more
(``SHARED_FIXED``, ``bench/row_cost.py``: 13.5 ms for two rows, then 3.1 to 3.5 ms a
row, against 7.1 ms for one). Beside seven others only a near-certain quote drafts.
(Counting the verify's rows alone, as an earlier rule did, cost 15-27% against no
drafts on the plain workload at 4 and 8 lanes; weighing the whole verify against a
token's share, as the next one did, 6-9% on the quote at 8 lanes. Alone, the measured
fixed part drafted longer and failed more on the quote than ``ROW_COST`` does:
``bench/README.md``.)
"""

from __future__ import annotations

import attrs

NGRAM = 3  # tokens that must match (llama-server's ngram-simple looks at as few)
MIN_NGRAM = 2  # a shorter match is tried when the longest finds nothing
MAX_DRAFT = 12  # drafted tokens per verify at most
MAX_PAUSE = 64  # plain tokens after failed verifies, at most
ROW_COST = 1.0  # alone: a pass's fixed cost over one row's cost
SHARED_FIXED = 2.1  # beside others: the fixed cost of a pass of two rows or more, in rows
DECAY = 0.8  # the weight the acceptance count keeps per verify
PRIOR = (4.0, 0.5)  # accepted tokens and failed verifies assumed before the first verify
SHADOW = 4  # tokens of a draft that did not pay watched against what decoding draws


def plain_rate(lanes: int) -> float:
    """Tokens per row's cost that plain decoding yields with ``lanes`` requests sharing
    each pass."""
    return 1 / (1 + ROW_COST) if lanes <= 1 else lanes / (lanes + SHARED_FIXED)


def verify_rate(drafts: int, expected: float, lanes: int) -> float:
    """Tokens per row's cost of a verify of ``drafts`` that yields ``expected`` tokens:
    alone the whole pass, beside others what it adds to the step (see above)."""
    if lanes <= 1:
        return expected / (ROW_COST + drafts + 1)
    return (expected - 1) / (SHARED_FIXED + drafts)


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
    _hits: float = PRIOR[0]  # accepted tokens, decayed per verify (the prior's too)
    _misses: float = PRIOR[1]  # verifies that rejected a token, decayed likewise
    _shadow: tuple[int, ...] = ()  # a draft not sent, watched against the drawn tokens
    _seen: int = 0  # of ``_shadow``'s tokens, how many were drawn so far

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
            if self._shadow:
                self._watch(token)

    def _watch(self, token: int) -> None:
        """Compare a drawn token with the watched draft; at its end or first miss, count
        it as a verify (the acceptance only: no verify ran)."""
        shadow = self._shadow
        if token == shadow[self._seen]:
            self._seen += 1
            if self._seen < len(shadow):
                return
        self._count(len(shadow), self._seen)
        self._shadow = ()

    @property
    def paused(self) -> bool:
        """Whether failed verifies keep this request decoding plainly for now."""
        return self._pause > 0

    @property
    def acceptance(self) -> float:
        """The chance that a drafted token is accepted, given the one before it was."""
        return self._hits / (self._hits + self._misses)

    def length(self, lanes: int, available: int | None = None) -> int:
        """The draft length, at most ``available`` (the tokens the match offers), that
        yields the most tokens per unit of pass cost with ``lanes`` requests decoding,
        or 0 where no such length beats plain decoding."""
        p = self.acceptance
        best, best_rate = 0, plain_rate(lanes)
        expected, chance = 1.0, 1.0  # tokens a verify of ``count`` drafts yields
        most = self.max_draft if available is None else min(available, self.max_draft)
        for count in range(1, most + 1):
            chance *= p
            expected += chance
            rate = verify_rate(count, expected, lanes)
            if rate > best_rate:
                best, best_rate = count, rate
        return best

    def propose(self, limit: int, lanes: int = 1) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the latest earlier match of the context's
        last n-gram (the longest n that matches), as many as pay with ``lanes``
        requests decoding; or none."""
        limit = min(limit, self.max_draft)
        history = self._history
        if limit <= 0 or self._pause or len(history) < MIN_NGRAM + 1:
            return ()
        follows = self._follows(limit)
        # The length must pay for what the match offers: a loop of three tokens offers
        # three, and three drafts beside seven others cost more than they yield.
        length = self.length(lanes, len(follows))
        if follows and not length and not self._shadow:
            self._shadow, self._seen = follows[:SHADOW], 0
        return follows[:length]

    def _follows(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the latest earlier match of the context's
        last n-gram (the longest n that matches); none without a match."""
        history = self._history
        for n in range(NGRAM, MIN_NGRAM - 1, -1):
            end = self._ends.get(tuple(history[-n:]))
            if end is not None:
                return tuple(history[end:end + limit])
        return ()

    def verified(self, drafted: int, accepted: int) -> None:
        """Record a verify: ``accepted`` of ``drafted`` tokens were what plain decoding drew."""
        self.drafted += drafted
        self.accepted += accepted
        self._count(drafted, accepted)
        if accepted:
            self._penalty = 1
        else:
            self._pause = self._penalty
            self._penalty = min(self._penalty * 2, MAX_PAUSE)

    def _count(self, drafted: int, accepted: int) -> None:
        """Update the acceptance with a verify of ``drafted`` that accepted ``accepted``."""
        self._hits = self._hits * DECAY + accepted
        self._misses = self._misses * DECAY + (accepted < drafted)
