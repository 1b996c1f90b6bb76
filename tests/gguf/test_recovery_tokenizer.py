"""Tool-call and think-block recovery fed the way the engine feeds it: one piece per
token of the shipped SmolLM2 tokenizer, so tags arrive cut where a real model cuts them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fakes.scripted import real_tokenizer

from butter.chat.recovery import (
    ContentDelta,
    ReasoningDelta,
    StreamParser,
    ToolCallArguments,
    ToolCallStart,
    parse_message,
)

MARKUP = ("<tool_call", "</tool_call", "<function=", "</function", "<parameter", "<think",
          "</think")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "metric": {"type": "boolean"}},
    }}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}},
    }}},
]
ON = {"tools": TOOLS, "parse_tools": True}


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


XML_WRAPPED = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
               "</function>\n</tool_call>")
XML_BARE = "<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n</function>"


def replay(text: str, **options: Any) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """Feed ``text`` token by token; check the delta contract; return what a client sees."""
    pieces = real_tokenizer().pieces(text)
    parser = StreamParser(**options)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if isinstance(delta, ToolCallStart):
            assert delta.index == len(names) and delta.index not in arguments
            names[delta.index] = delta.name
        elif isinstance(delta, ToolCallArguments):
            assert delta.index in names, "arguments before their call started"
            arguments[delta.index] = arguments.get(delta.index, "") + delta.fragment
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == calls
    # Cut at token boundaries or not cut at all, the answer is the same.
    whole = parse_message(text, **options)
    assert (whole.content or "", whole.reasoning or "") == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    return content, reasoning, calls


def test_tags_really_are_split_across_tokens() -> None:
    # Otherwise this file would test nothing the whole-text tests do not.
    for tag in ("<tool_call>", "</tool_call>", "<function=", "<think>", "</think>"):
        assert len([p for p in real_tokenizer().pieces(tag) if p]) > 1, tag


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        pytest.param(hermes("get_weather", {"city": "Paris"}), "",
                     [("get_weather", {"city": "Paris"})], id="hermes"),
        pytest.param(hermes("get_weather", {"city": "Zürich", "note": "日本 ✓"}), "",
                     [("get_weather", {"city": "Zürich", "note": "日本 ✓"})],
                     id="hermes-multibyte"),
        pytest.param('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'
                     "</tool_call>", "", [("get_time", {"zone": "UTC"})],
                     id="hermes-arguments-as-string"),
        pytest.param(XML_WRAPPED, "",
                     [("get_weather", {"city": "Paris", "days": 3, "metric": True})],
                     id="xml-wrapped"),
        pytest.param(XML_BARE, "", [("get_time", {"zone": "Europe/Paris"})], id="xml-bare"),
        pytest.param(hermes("get_weather", {"city": "Paris"}) + "\n"
                     + hermes("get_time", {"zone": "CET"}), "",
                     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
                     id="two-hermes-blocks"),
        pytest.param('<tool_call>\n[{"name": "get_time", "arguments": {}}, '
                     '{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n</tool_call>',
                     "", [("get_time", {}), ("get_weather", {"city": "Oslo"})],
                     id="hermes-list"),
        pytest.param(XML_WRAPPED + "\n" + XML_BARE, "",
                     [("get_weather", {"city": "Paris", "days": 3, "metric": True}),
                      ("get_time", {"zone": "Europe/Paris"})], id="xml-both-forms"),
        pytest.param("Let me check the weather for you.\n\n"
                     + hermes("get_weather", {"city": "Paris"}),
                     "Let me check the weather for you.",
                     [("get_weather", {"city": "Paris"})], id="text-before-call"),
        pytest.param("Checking.\n" + XML_BARE + "\nDone.", "Checking.\n\nDone.",
                     [("get_time", {"zone": "Europe/Paris"})], id="text-around-call"),
        pytest.param("Use a < b and <b>bold</b> here.", "Use a < b and <b>bold</b> here.", [],
                     id="angle-brackets-are-text"),
    ],
)
def test_calls_recovered_at_token_boundaries(text: str, content: str,
                                             calls: list[tuple[str, Any]]) -> None:
    got_content, reasoning, got_calls = replay(text, **ON)
    assert got_calls == calls
    assert got_content == content
    assert reasoning == ""
    assert not any(tag in got_content for tag in MARKUP)


BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
PROSE_INSIDE = "<tool_call>\nI would call a tool here.\n</tool_call>"
XML_BAD_GRAMMAR = "<function=get_weather>\nnot a parameter\n</function>"
NEVER_CLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'


MALFORMED = [  # (markup that makes no call, the content it gives up: its text, no tags)
    (BAD_JSON, '\n{"name": "get_weather", "arguments": {"city": }}\n'),
    (PROSE_INSIDE, "\nI would call a tool here."),
    (XML_BAD_GRAMMAR, "\nnot a parameter"),
    (NEVER_CLOSED, '\n{"name": "get_weather", "arguments": {"city": "Pa'),
]


@pytest.mark.parametrize(("malformed", "text"), MALFORMED)
def test_malformed_markup_gives_up_its_text_without_tags(malformed: str, text: str) -> None:
    content, reasoning, calls = replay(malformed, **ON)
    assert (content, reasoning, calls) == (text, "", [])
    assert not any(tag in content for tag in MARKUP)


@pytest.mark.parametrize(("malformed", "text"), MALFORMED[:3])
def test_a_call_after_malformed_markup_is_recovered(malformed: str, text: str) -> None:
    content, _, calls = replay(malformed + "\n" + hermes("get_time", {"zone": "UTC"}), **ON)
    assert calls == [("get_time", {"zone": "UTC"})]
    assert content.strip() == text.strip()


def test_calls_are_not_parsed_when_tools_are_off() -> None:
    text = hermes("get_weather", {"city": "Paris"})
    content, _, calls = replay(text, tools=TOOLS, parse_tools=False)
    assert calls == [] and content == text


def test_think_block_then_call() -> None:
    text = ("<think>\nThe user wants the weather, so I call get_weather.\n</think>\n\n"
            + hermes("get_weather", {"city": "Paris"}))
    content, reasoning, calls = replay(text, **ON)
    assert reasoning == "The user wants the weather, so I call get_weather."
    assert content == ""
    assert calls == [("get_weather", {"city": "Paris"})]


def test_think_block_then_text() -> None:
    content, reasoning, calls = replay("<think>Short thought.</think>\n\nThe answer is 4.")
    assert (content, reasoning, calls) == ("The answer is 4.", "Short thought.", [])


def test_think_opened_by_the_template() -> None:
    text = "Still thinking about <tool_call> tags.\n</think>\n\n" + XML_BARE
    content, reasoning, calls = replay(text, think_open=True, **ON)
    assert reasoning == "Still thinking about <tool_call> tags."
    assert content == ""
    assert calls == [("get_time", {"zone": "Europe/Paris"})]


def test_scripted_pieces_join_back_to_the_text() -> None:
    text = "Zürich 日本 " + hermes("get_weather", {"city": "Paris"}) + " 🙂"
    assert "".join(real_tokenizer().pieces(text)) == text
