"""AnswerReader: the engine's text read as a chat answer, with a forced tool-call opening
written by the prompt on the model's behalf."""

from __future__ import annotations

import json
from typing import Any

from butter.chat.answer import AnswerReader
from butter.chat.prompt import PromptPlan
from butter.chat.recovery import ContentDelta, Delta, ToolCallArguments, ToolCallStart

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}},
    }}},
]
REQUIRED = "<tool_call>\n"  # tool_choice "required" or naming a function


def reader(prefix: str = "") -> AnswerReader:
    plan = PromptPlan(text="<prompt>" + prefix, parse_tools=True, think_open=False,
                      answer_prefix=prefix)
    return AnswerReader.for_plan(plan, tools=TOOLS, formats=None)


def read(prefix: str, chunks: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    """Content and calls a client sees, checking the streamed calls match `tool_calls`."""
    answer = reader(prefix)
    deltas: list[Delta] = answer.start()
    for chunk in chunks:
        deltas += answer.feed(chunk)
    deltas += answer.finish()
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    arguments = ["".join(d.fragment for d in deltas
                         if isinstance(d, ToolCallArguments) and d.index == s.index)
                 for s in starts]
    streamed = [(s.name, json.loads(a)) for s, a in zip(starts, arguments, strict=True)]
    assert streamed == [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return content, streamed


def every_split(prefix: str, text: str) -> tuple[str, list[tuple[str, Any]]]:
    """The outcome for the text whole; the same for each cut in two and char by char."""
    whole = read(prefix, [text])
    for cut in range(1, len(text)):
        assert read(prefix, [text[:cut], text[cut:]]) == whole, cut
    assert read(prefix, list(text)) == whole
    return whole


def test_forced_opening_then_call() -> None:
    content, calls = every_split(REQUIRED, '{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert calls == [("f", {"a": 1})]
    assert content == ""


def test_forced_opening_cut_by_max_tokens_is_not_content() -> None:
    content, calls = every_split(REQUIRED, '{"name": "f", "argu')
    assert calls == []
    assert "<tool_call" not in content
    assert content == '{"name": "f", "argu'


def test_start_emits_nothing_for_the_forced_opening() -> None:
    assert reader(REQUIRED).start() == []
    assert reader().start() == []


def test_models_own_unclosed_opening_gives_up_its_text_without_the_tag() -> None:
    assert every_split("", '<tool_call>{"name"') == ('{"name"', [])


def test_malformed_forced_call_leaves_no_markup_in_content() -> None:
    # The SPEC section 4 bug: a forced call whose JSON does not parse leaked its close tag.
    for text in ("{{1}} // 1\n</tool_call}}\n</tool_call>", "1}\n</tool_call>"):
        content, calls = every_split(REQUIRED, text)
        assert calls == [] and "tool_call" not in content.replace("tool_call}}", "")
        assert "</tool_call>" not in content and "<tool_call>" not in content


def test_a_stray_close_tag_is_dropped() -> None:
    content, calls = every_split("", "Done.</tool_call> Bye.")
    assert calls == [] and content == "Done. Bye."


def test_models_own_call_without_prefix() -> None:
    content, calls = every_split("", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n'
                                     "</tool_call>")
    assert calls == [("f", {"a": 2})]
    assert content == "Sure."


def test_forced_opening_followed_by_prose_is_not_content() -> None:
    content, calls = read(REQUIRED, ["I cannot call a tool for that."])
    assert calls == []
    assert "<tool_call" not in content
