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
"""

from __future__ import annotations

import attrs

NGRAM = 3  # tokens that must match (llama-server's ngram-simple looks at as few)
MIN_NGRAM = 2  # a shorter match is tried when the longest finds nothing
MAX_DRAFT = 12  # drafted tokens per verify at most
MAX_PAUSE = 64  # plain tokens after failed verifies, at most


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

    def propose(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the latest earlier match of the context's
        last n-gram (the longest n that matches), or none."""
        limit = min(limit, self.max_draft)
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
        if accepted:
            self._penalty = 1
        else:
            self._pause = self._penalty
            self._penalty = min(self._penalty * 2, MAX_PAUSE)
