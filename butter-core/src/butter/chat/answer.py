"""Reading the engine's text as a chat answer: one path for HTTP and the library.

The engine emits plain text; an :class:`AnswerReader` turns it into recovered
deltas (content, reasoning, tool calls) with the request's parser, and accounts for
text the prompt wrote on the model's behalf (a forced ``<tool_call>`` opening).
"""

from __future__ import annotations

from butter.chat.prompt import PromptPlan
from butter.chat.recovery import ContentDelta, Delta, StreamParser, ToolCall, ToolCallStart
from butter.engine.events import Failed, Finished, TextDelta
from butter.generation import LogprobsDelta, Usage


class AnswerReader:
    def __init__(self, parser: StreamParser, plan: PromptPlan) -> None:
        self._parser = parser
        self._prefix = plan.answer_prefix
        self._opening = plan.answer_prefix.strip()
        self._unshown = self._opening  # what of the forced opening may still surface

    @classmethod
    def for_plan(cls, plan: PromptPlan, *, tools, formats) -> AnswerReader:
        parser = StreamParser(tools=tools, parse_tools=plan.parse_tools,
                              think_open=plan.think_open, formats=formats)
        return cls(parser, plan)

    def start(self) -> list[Delta]:
        return self._filter(self._parser.feed(self._prefix)) if self._prefix else []

    def feed(self, text: str) -> list[Delta]:
        return self._filter(self._parser.feed(text))

    def finish(self) -> list[Delta]:
        return self._filter(self._parser.finish())

    def _filter(self, deltas: list[Delta]) -> list[Delta]:
        """Hide the forced opening when the parser gives it up as content.

        That happens when the model did not write a call after all (prose, malformed
        JSON, or cut by max_tokens): the opening was ours, not the model's.
        """
        if not self._unshown:
            return deltas
        out: list[Delta] = []
        for delta in deltas:
            if self._unshown and isinstance(delta, ContentDelta):
                text = delta.text.lstrip() if self._unshown == self._opening else delta.text
                if text.startswith(self._unshown):
                    text, self._unshown = text[len(self._unshown):].lstrip(), ""
                elif self._unshown.startswith(text):
                    text, self._unshown = "", self._unshown[len(text):]
                else:
                    self._unshown = ""
                if text:
                    out.append(ContentDelta(text))
                continue
            if isinstance(delta, ToolCallStart):
                self._unshown = ""  # the model did write the call
            out.append(delta)
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._parser.tool_calls


class Answer:
    """One request's engine events read as deltas: the answer loop the server
    (``serving.Generation``) and the library (``Model.generate``) both run.

    ``start()`` first, then ``on(event)`` for each event until ``done``; a failure raises
    its error. Afterwards ``finish_reason``, ``stop_sequence``, ``usage`` and
    ``tool_calls`` say how it ended."""

    def __init__(self, reader: AnswerReader) -> None:
        self._reader = reader
        self.done = False
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None

    def start(self) -> list[Delta]:
        return self._reader.start()

    def on(self, event: object) -> list[Delta]:
        """The deltas ``event`` yields (none for an admission)."""
        if isinstance(event, TextDelta):
            deltas: list[Delta] = [LogprobsDelta(event.logprobs)] if event.logprobs else []
            return deltas + self._reader.feed(event.text)
        if isinstance(event, Finished):
            self.done = True
            deltas = self._reader.finish()
            self.usage = event.usage
            self.stop_sequence = event.stop_sequence
            self.finish_reason = "tool_calls" if self._reader.tool_calls else event.reason
            return deltas
        if isinstance(event, Failed):
            self.done = True
            raise event.error
        return []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._reader.tool_calls
