"""Recover tool calls and think blocks from model text, streamed or whole.

Model output arrives in chunks of any size. `StreamParser` turns it into typed deltas:
visible text (`ContentDelta`), ``<think>…</think>`` text (`ReasoningDelta`) and tool
calls (`ToolCallStart` then `ToolCallArguments`). `parse_message` does the same for
a finished answer. The markup families live in `butter.chat.toolformats`.

Rules a client can rely on:

- No markup of a recognised block reaches content; text that might start a tag is held
  back until it is told apart, and released as text as soon as it cannot be one.
- Markup that does not parse (bad JSON, a block still open at the end) gives its text
  up as content *without* the tags, and a close tag with no block open is dropped: no
  raw tool-call markup ever reaches content. Nothing raises out of `feed` or `finish`.
- A tool call is emitted when its block closes: only then is it known to be a call,
  and a streamed call cannot be taken back.
- Whitespace that only separates text from markup (the blank line after ``</think>``,
  the newline before a ``<tool_call>``) is dropped; whitespace between two pieces of
  text is kept.
- The result does not depend on how the text was split into chunks.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from butter.chat.toolformats import BUILTIN_TOOL_FORMATS, NOT_A_BLOCK, ToolFormat

__all__ = [
    "BUILTIN_TOOL_FORMATS",
    "THINK_CLOSE",
    "THINK_OPEN",
    "ContentDelta",
    "Delta",
    "ParsedMessage",
    "ReasoningDelta",
    "StreamParser",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolFormat",
    "parse_message",
]

_log = logging.getLogger(__name__)

THINK_OPEN: Final = "<think>"
THINK_CLOSE: Final = "</think>"


@attrs.frozen
class ContentDelta:
    """Visible assistant text."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """Text inside a think block."""

    text: str


@attrs.frozen
class ToolCallStart:
    """A tool call begins; its arguments follow in `ToolCallArguments` with the same index."""

    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallArguments:
    """A piece of a call's arguments; a call's pieces join into one JSON object."""

    index: int
    fragment: str


Delta = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArguments


@attrs.frozen
class ToolCall:
    """A recovered call; ``arguments`` is a JSON object string."""

    id: str
    name: str
    arguments: str


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@attrs.define
class _Channel:
    """Holds whitespace at the edges of one kind of text (content or reasoning).

    Trailing whitespace waits for what follows: more text releases it, markup followed
    by the end of the stream drops it. Leading whitespace right after markup, before
    any text of this kind went out, is dropped. Where no markup can come (``hold``
    off: a completion, which has no think block and no tools), whitespace goes out at
    once, as llama-server sends it.
    """

    hold: bool = True
    held: str = ""
    started: bool = False
    after_markup: bool = False

    def push(self, text: str) -> str:
        """Text to emit now."""
        pending = self.held + text
        body = pending.rstrip() if self.hold else pending
        if not body:
            self.held = pending
            return ""
        self.held = pending[len(body) :]
        if self.after_markup and not self.started:
            body = body.lstrip()
        self.started = True
        self.after_markup = False
        return body

    def markup(self) -> None:
        self.after_markup = True

    def finish(self) -> str:
        """The held whitespace to emit at the end of the stream."""
        held, self.held = self.held, ""
        return "" if self.after_markup else held


class _Mode(enum.Enum):
    TEXT = enum.auto()  # content, watching for open tags
    THINK = enum.auto()  # inside a think block, watching for its close
    BLOCK = enum.auto()  # inside a tool-call block, waiting for a format to close it


class StreamParser:
    """Turns streamed model text into `Delta` values.

    ``parse_tools`` is on when the request declared tools and tool_choice is not
    "none"; ``tools`` is that request's OpenAI tool list, used to type values of
    formats that need a schema. ``think_open`` says the chat template already opened
    a think block, so output is reasoning until ``</think>``. ``formats`` defaults to
    `BUILTIN_TOOL_FORMATS`; when two share an open tag the earlier one wins.
    """

    def __init__(
        self,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        parse_tools: bool = False,
        parse_think: bool = True,
        think_open: bool = False,
        formats: Sequence[ToolFormat] | None = None,
    ) -> None:
        self._tools = list(tools or ())
        self._formats = tuple(BUILTIN_TOOL_FORMATS if formats is None else formats)
        if not parse_tools:
            self._formats = ()
        tags = [THINK_OPEN] if parse_think else []
        closes: list[str] = []
        for fmt in self._formats:
            tags += [tag for tag in fmt.open_tags if tag and tag not in tags]
            closes += [tag for tag in (*fmt.close_tags, *fmt.inner_tags)
                       if tag and tag not in closes]
        self._tags = tuple(tags)
        self._closes = tuple(closes)  # dropped wherever they stand outside a block
        watched = tags + closes
        first_chars = "".join(sorted({tag[0] for tag in watched}))
        self._tag_start = re.compile(f"[{re.escape(first_chars)}]") if watched else None
        self._markup = _markup_pattern(self._formats)
        self._mode = _Mode.THINK if parse_think and think_open else _Mode.TEXT
        self._buffer = ""
        self._content = _Channel(hold=bool(watched))
        self._reasoning = _Channel(after_markup=True)
        self._block_tag = ""
        self._candidates: list[ToolFormat] = []
        self._rejected_end = 0
        self._calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return list(self._calls)

    def feed(self, text: str) -> list[Delta]:
        """Deltas for the text generated since the last call."""
        self._buffer += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return _merged(out)

    def finish(self) -> list[Delta]:
        """Deltas for whatever was held back, at the end of generation."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self._mode is _Mode.THINK:  # the stream ended inside a think block
            self._reasoning.markup()
        self._emit(out, ReasoningDelta, self._reasoning.finish())
        self._emit(out, ContentDelta, self._content.finish())
        self._mode = _Mode.TEXT
        return _merged(out)

    # Each step handles the buffer in the current mode and says whether the mode
    # changed, so that the caller should step again.

    def _step(self, out: list[Delta], *, final: bool) -> bool:
        if self._mode is _Mode.TEXT:
            return self._step_text(out, final=final)
        if self._mode is _Mode.THINK:
            return self._step_think(out, final=final)
        return self._step_block(out, final=final)

    def _step_text(self, out: list[Delta], *, final: bool) -> bool:
        start, tag = self._find_tag(self._buffer)
        if tag is None and final:
            held = self._buffer[start:]
            if len(held) > 1 and any(close.startswith(held) for close in self._closes):
                self._buffer = self._buffer[:start]  # a close tag cut off at the end
            start = len(self._buffer)  # what looked like a tag's start is plain text
        self._emit(out, ContentDelta, self._content.push(self._buffer[:start]))
        self._buffer = self._buffer[start:]
        if tag is None:
            return False
        if tag in self._closes:  # a close tag with no block open: markup, never content
            end = _tag_end(self._buffer, tag)
            if end is None and not final:
                return False  # ``<parameter=`` waits for its ``>``
            self._buffer = self._buffer[end or len(tag):]
            self._content.markup()
            return True
        if tag == THINK_OPEN:
            self._buffer = self._buffer[len(tag) :]
            self._content.markup()
            self._reasoning.markup()
            self._mode = _Mode.THINK
        else:
            self._block_tag = tag
            self._candidates = [fmt for fmt in self._formats if tag in fmt.open_tags]
            self._rejected_end = NOT_A_BLOCK
            self._mode = _Mode.BLOCK
        return True

    def _find_tag(self, text: str) -> tuple[int, str | None]:
        """Where the first open tag starts and which it is; (index, None) when the text
        from index on could still become one; (len(text), None) when there is none."""
        if self._tag_start is None:
            return len(text), None
        watched = self._tags + self._closes
        for match in self._tag_start.finditer(text):
            start = match.start()
            for tag in watched:
                if text.startswith(tag, start):
                    return start, tag
            rest = text[start : start + max(map(len, watched))]
            if any(len(rest) < len(tag) and tag.startswith(rest) for tag in watched):
                return start, None
        return len(text), None

    def _step_think(self, out: list[Delta], *, final: bool) -> bool:
        close = self._buffer.find(THINK_CLOSE)
        if close < 0:
            keep = 0 if final else _partial_suffix(self._buffer, THINK_CLOSE)
            cut = len(self._buffer) - keep
            self._emit(out, ReasoningDelta, self._reasoning.push(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            return False
        self._emit(out, ReasoningDelta, self._reasoning.push(self._buffer[:close]))
        self._reasoning.markup()
        self._content.markup()
        self._buffer = self._buffer[close + len(THINK_CLOSE) :]
        self._mode = _Mode.TEXT
        return True

    def _step_block(self, out: list[Delta], *, final: bool) -> bool:
        block = self._buffer
        waiting: list[ToolFormat] = []
        for fmt in self._candidates:
            end = _block_end(fmt, block)
            if end is None and final:
                end = NOT_A_BLOCK  # still open at the end of the stream
            # A format that closed the block waits while an earlier one might still
            # claim it, so the winner does not depend on the chunking.
            if end is None or (end != NOT_A_BLOCK and waiting):
                waiting.append(fmt)
                continue
            if end != NOT_A_BLOCK:
                calls = _parse(fmt, block[:end], self._tools)
                if calls:
                    self._emit_calls(out, calls)
                    self._buffer = block[end:]
                    self._mode = _Mode.TEXT
                    return True
                end = self._inner_tag(block, end)
            self._rejected_end = max(self._rejected_end, end)
        self._candidates = waiting
        if waiting:
            return False
        # No format takes it: its text is content, without the markup. A malformed block
        # goes out up to the first open tag inside it; a rejected or unclosed one gives
        # up only its open tag. The rest is scanned again.
        end = max(self._rejected_end, _tag_end(block, self._block_tag) or len(self._block_tag))
        self._emit(out, ContentDelta, self._content.push(self._markup.sub("", block[:end])))
        self._buffer = block[end:]
        self._mode = _Mode.TEXT
        return True

    def _inner_tag(self, block: str, end: int) -> int:
        """Where the first tool-call open tag inside ``block[:end]`` starts, after the
        block's own; ``end`` when there is none.

        A block left unclosed (a call cut short, then a fresh one) is closed by the next
        call's close tag; the text from the inner tag on may still hold that call.
        """
        starts = [block.find(tag, len(self._block_tag), end) for tag in self._tags
                  if tag != THINK_OPEN]
        return min((start for start in starts if start >= 0), default=end)

    def _emit_calls(self, out: list[Delta], calls: list[tuple[str, str]]) -> None:
        self._content.markup()
        for name, arguments in calls:
            call = ToolCall(id=_new_call_id(), name=name, arguments=arguments)
            index = len(self._calls)
            self._calls.append(call)
            out.append(ToolCallStart(index=index, id=call.id, name=name))
            out.append(ToolCallArguments(index=index, fragment=arguments))

    @staticmethod
    def _emit(out: list[Delta], kind: type[ContentDelta] | type[ReasoningDelta], text: str) -> None:
        if text:
            out.append(kind(text))


def _tag_end(text: str, tag: str) -> int | None:
    """Where the tag at the start of ``text`` ends: past its ``>`` for a tag ending in
    ``=`` (``<function=name>``), None while that ``>`` has not arrived."""
    if not tag.endswith("="):
        return len(tag)
    close = text.find(">", len(tag))
    newline = text.find("\n", len(tag))
    if close < 0 or 0 <= newline < close:
        return None if close < 0 and newline < 0 else len(tag)
    return close + 1


def _markup_pattern(formats: Sequence[ToolFormat]) -> re.Pattern[str]:
    """The tags of ``formats``; an open tag ending in ``=`` (``<function=``) runs to ``>``."""
    parts = []
    for fmt in formats:
        for tag in (*fmt.open_tags, *fmt.close_tags, *fmt.inner_tags):
            if tag:
                parts.append(re.escape(tag) + (r"[^>\n]*>" if tag.endswith("=") else ""))
    return re.compile("|".join(sorted(set(parts), key=len, reverse=True)) or r"(?!)")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


# Formats can come from plugins; a plugin's bug must cost at most its own block,
# never the stream, so these two calls treat any exception as "not a block".


def _block_end(fmt: ToolFormat, block: str) -> int | None:
    try:
        end = fmt.block_end(block)
    except Exception:
        _log.warning("tool format %r failed to scan a block", fmt, exc_info=True)
        return NOT_A_BLOCK
    if end is None or (isinstance(end, int) and 0 < end <= len(block)):
        return end
    return NOT_A_BLOCK


def _parse(fmt: ToolFormat, block: str, tools: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The block's calls with their arguments as JSON text; empty when there are none."""
    try:
        calls = fmt.parse(block, tools) or []
        if not all(isinstance(name, str) and name and isinstance(a, dict) for name, a in calls):
            return []
        return [
            (name, json.dumps(args, ensure_ascii=False, allow_nan=False)) for name, args in calls
        ]
    except Exception:
        _log.warning("tool format %r failed to parse a block", fmt, exc_info=True)
        return []


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Joins neighbouring text deltas of the same kind."""
    merged: list[Delta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if isinstance(delta, ContentDelta | ReasoningDelta) and type(last) is type(delta):
            merged[-1] = type(delta)(last.text + delta.text)  # type: ignore[union-attr]
        else:
            merged.append(delta)
    return merged


@attrs.frozen
class ParsedMessage:
    """A whole answer, split like `StreamParser` splits a stream.

    ``content`` is None when it is empty or whitespace and there are tool calls;
    ``reasoning`` is None when there was no think text.
    """

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def parse_message(
    text: str,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    parse_tools: bool = False,
    parse_think: bool = True,
    think_open: bool = False,
    formats: Sequence[ToolFormat] | None = None,
) -> ParsedMessage:
    """Split a finished answer into content, reasoning and tool calls."""
    parser = StreamParser(
        tools=tools,
        parse_tools=parse_tools,
        parse_think=parse_think,
        think_open=think_open,
        formats=formats,
    )
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    calls = parser.tool_calls
    return ParsedMessage(
        content=None if calls and not content.strip() else content,
        reasoning=reasoning or None,
        tool_calls=calls,
    )
