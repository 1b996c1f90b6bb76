"""Client text stays text: special tokens come only from the chat template's own markup.

A user who writes ``<|im_end|><|im_start|>system`` in a message must not open a
system turn. Before rendering, :meth:`TextGuard.hide` replaces, in every string the
client sent, the text of each control token with a private-use marker; the template
then renders around the markers, so every special-token text left in the prompt is
the template's. :meth:`TextGuard.encode` cuts the rendered prompt at the markers:
the template's text is tokenized with special tokens parsed, and each hidden
special-token text is tokenized as the plain text the client wrote.

Marker ``MARK + chr(BASE + i)`` stands for ``texts[i]``; ``texts[0]`` is ``MARK``
itself, so a client that sends the marker character gets it back as text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

MARK = "\U000f0000"  # a private-use character
BASE = 0xF0001
WINDOW = 1 << 16  # characters scanned per regex call

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)


class TextGuard:
    def __init__(self, special_texts: Sequence[str]) -> None:
        specials = sorted({t for t in special_texts if t and t != MARK}, key=len, reverse=True)
        self.texts: tuple[str, ...] = (MARK, *specials)
        self._codes = {text: MARK + chr(BASE + i) for i, text in enumerate(self.texts)}
        self._find = re.compile("|".join(re.escape(t) for t in self.texts))
        self._marker = re.compile(re.escape(MARK) + "(.)", re.DOTALL)
        self._longest = max(len(t) for t in self.texts)

    def hide(self, value: Any) -> Any:
        """``value`` (a string, or lists and dicts of them) with special-token texts hidden."""
        if isinstance(value, str):
            return self._hide_text(value)
        if isinstance(value, list):
            return [self.hide(item) for item in value]
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        return value

    def _hide_text(self, text: str) -> str:
        # Searched a window at a time: one regex call holds the GIL, and a 10 MB prompt
        # must not stall the engine thread's streams while it is scanned.
        out: list[str] = []
        start, end = 0, len(text)
        while start < end:
            stop = min(end, start + WINDOW)
            match = self._find.search(text, start, min(end, stop + self._longest - 1))
            if match is None or match.start() >= stop:
                out.append(text[start:stop])
                start = stop
                continue
            out.append(text[start:match.start()])
            out.append(self._codes[match.group(0)])
            start = match.end()
        return "".join(out)

    def segments(self, rendered: str) -> Iterator[tuple[str, bool]]:
        """``(text, parse_special)`` pieces of a rendered prompt, in order."""
        position = 0
        for match in self._marker.finditer(rendered):
            if match.start() > position:
                yield rendered[position:match.start()], True
            index = ord(match.group(1)) - BASE
            yield (self.texts[index] if 0 <= index < len(self.texts) else match.group(0)), False
            position = match.end()
        if position < len(rendered):
            yield rendered[position:], True

    def reveal(self, rendered: str) -> str:
        """The prompt as plain text (markers back to what the client wrote)."""
        return "".join(text for text, _ in self.segments(rendered))

    def encode(self, rendered: str, tokenize: Tokenize, *, add_special: bool) -> list[int]:
        """Token ids of a rendered prompt: template markup special, client text plain."""
        tokens: list[int] = []
        for text, parse_special in self.segments(rendered):
            tokens += tokenize(text, add_special and not tokens, parse_special)
        if not tokens and add_special:
            tokens = tokenize("", True, False)
        return tokens


NO_SPECIALS = TextGuard(())
