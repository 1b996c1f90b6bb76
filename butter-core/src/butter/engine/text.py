"""Turning sampled tokens into client text: UTF-8 safe, with stop strings held back."""

from __future__ import annotations

import codecs


class Detokenizer:
    """Token pieces (bytes) in, complete UTF-8 text out; a split character waits.

    A character still incomplete when generation ends (cut by ``max_tokens``) is
    dropped, as llama-server drops it: half a character is no text, and a U+FFFD in
    its place would be a character the model never wrote."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        self._decoder.reset()  # what it still holds is the start of a character, no more
        return ""


class StopMatcher:
    """Finds the first stop string in the generated text.

    Text that might be the start of a stop string is held back, so a client never
    sees part of a stop sequence.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once found

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was reached)."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [(i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            hit, self.matched = min(hits, key=lambda h: h[0])
            self._held = ""
            return buffer[:hit], True
        keep = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
