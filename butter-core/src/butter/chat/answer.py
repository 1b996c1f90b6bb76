"""Reading the engine's text as a chat answer: one path for HTTP and the library.

The engine emits plain text; an :class:`AnswerReader` turns it into recovered
deltas (content, reasoning, tool calls) with the request's parser, and accounts for
text the prompt wrote on the model's behalf (a forced ``<tool_call>`` opening).
"""

from __future__ import annotations

from butter.chat.prompt import PromptPlan
from butter.chat.recovery import ContentDelta, Delta, StreamParser, ToolCall


class AnswerReader:
    def __init__(self, parser: StreamParser, plan: PromptPlan) -> None:
        self._parser = parser
        self._prefix = plan.answer_prefix

    @classmethod
    def for_plan(cls, plan: PromptPlan, *, tools, formats) -> "AnswerReader":
        parser = StreamParser(tools=tools, parse_tools=plan.parse_tools,
                              think_open=plan.think_open, formats=formats)
        return cls(parser, plan)

    def start(self) -> list[Delta]:
        return self._parser.feed(self._prefix) if self._prefix else []

    def feed(self, text: str) -> list[Delta]:
        return self._parser.feed(text)

    def finish(self) -> list[Delta]:
        deltas = self._parser.finish()
        if self._prefix and not self._parser.tool_calls:
            # A forced call the model never closed (e.g. cut by max_tokens): the opening
            # was ours, not the model's, so it is not shown as content.
            deltas = _strip_leading(deltas, self._prefix)
        return deltas

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._parser.tool_calls


def _strip_leading(deltas: list[Delta], prefix: str) -> list[Delta]:
    out: list[Delta] = []
    stripped = False
    for delta in deltas:
        if not stripped and isinstance(delta, ContentDelta):
            stripped = True
            text = delta.text.lstrip()
            opening = prefix.strip()
            if text.startswith(opening):
                text = text[len(opening):].lstrip()
            if text:
                out.append(ContentDelta(text))
            continue
        out.append(delta)
    return out
