"""Tool-call and think-block recovery, fed at every possible chunk boundary."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from butter.chat.recovery import (
    ContentDelta,
    ParsedMessage,
    ReasoningDelta,
    StreamParser,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    parse_message,
)
from butter.chat.toolformats import BUILTIN_TOOL_FORMATS, NOT_A_BLOCK, JsonToolFormat

MARKUP = ("<tool_call", "</tool_call", "<function=", "<think", "</think")


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}),
    _tool(
        "typed",
        {
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "whole": {"type": "number"},
            "flag": {"type": "boolean"},
            "off": {"type": "boolean"},
            "one": {"type": "boolean"},
            "options": {"type": "object"},
            "items": {"type": "array"},
            "broken": {"type": "object"},
            "text": {"type": "string"},
            "bad_count": {"type": "integer"},
            "maybe": {"type": ["integer", "null"]},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        },
    ),
    {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "$defs": {"Point": {"type": "object"}, "Unit": {"type": "string"}},
        "properties": {"at": {"$ref": "#/$defs/Point"}, "unit": {"$ref": "#/$defs/Unit"}},
    }}},
]
ON = {"tools": TOOLS, "parse_tools": True}

WEATHER_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
WEATHER_BARE = "<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>"
PARIS = ("get_weather", {"city": "Paris"})


def splits(text: str, *, seed: int = 0) -> Iterator[list[str]]:
    """The text whole, cut in two at every boundary, one char at a time, and cut at
    random places."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(8):
        if len(text) < 2:
            break
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@attrs.frozen
class Outcome:
    content: str
    reasoning: str
    arguments: tuple[str, ...]
    calls: tuple[tuple[str, Any], ...]


def run(chunks: list[str], **options: Any) -> Outcome:
    """Feeds the chunks and checks the call deltas' contract on the way."""
    parser = StreamParser(**options)
    deltas = [delta for chunk in chunks for delta in parser.feed(chunk)] + parser.finish()
    starts: list[ToolCallStart] = []
    arguments: dict[int, str] = {}
    for delta in deltas:
        if isinstance(delta, ToolCallStart):
            assert delta.index == len(starts)
            assert delta.id.startswith("call_") and len(delta.id) == len("call_") + 24
            starts.append(delta)
        elif isinstance(delta, ToolCallArguments):
            assert delta.index < len(starts), "arguments before their start"
            arguments[delta.index] = arguments.get(delta.index, "") + delta.fragment
        else:
            assert isinstance(delta, ContentDelta | ReasoningDelta) and delta.text
    assert len({start.id for start in starts}) == len(starts)
    joined = tuple(arguments[start.index] for start in starts)
    assert all(isinstance(json.loads(args), dict) for args in joined)
    assert parser.tool_calls == [
        ToolCall(id=start.id, name=start.name, arguments=args)
        for start, args in zip(starts, joined, strict=True)
    ]
    return Outcome(
        content="".join(d.text for d in deltas if isinstance(d, ContentDelta)),
        reasoning="".join(d.text for d in deltas if isinstance(d, ReasoningDelta)),
        arguments=joined,
        calls=tuple((s.name, json.loads(a)) for s, a in zip(starts, joined, strict=True)),
    )


def assert_recovers(
    text: str,
    *,
    content: str,
    calls: list[tuple[str, Any]],
    reasoning: str = "",
    markup_free: bool = True,
    **options: Any,
) -> None:
    whole = run([text], **options)
    for chunks in splits(text):
        outcome = run(chunks, **options)
        assert outcome == whole, chunks
    assert whole.content == content
    assert whole.reasoning == reasoning
    assert list(whole.calls) == calls
    if markup_free:
        assert not any(tag in whole.content for tag in MARKUP)


CASES = [
    pytest.param(WEATHER_JSON, "", [PARIS], "", ON, id="hermes"),
    pytest.param(
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        "", [PARIS], "", ON, id="hermes-arguments-as-string",
    ),
    pytest.param(
        '<tool_call> {"name": "get_weather", "parameters": {"city": "Paris"}} </tool_call>',
        "", [PARIS], "", ON, id="hermes-parameters-key",
    ),
    pytest.param(
        '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>',
        "", [("no_such_tool", {})], "", ON, id="unknown-name-accepted",
    ),
    pytest.param(
        WEATHER_XML, "", [("get_weather", {"city": "Paris", "days": 3})], "", ON, id="xml"
    ),
    pytest.param(WEATHER_BARE, "", [("get_weather", {"city": "Lyon"})], "", ON, id="xml-bare"),
    pytest.param(
        "<tool_call>\n<function=write>\n<parameter=code>\nx = '</parameter>'\n</parameter>\n"
        "</function>\n<function=run>\n</function>\n</tool_call>",
        "", [("write", {"code": "x = '</parameter>'"}), ("run", {})], "", ON,
        id="xml-value-holding-closing-tag",
    ),
    pytest.param(
        f"{WEATHER_JSON}\n{WEATHER_XML}\n{WEATHER_BARE}\n",
        "",
        [PARIS, ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Lyon"})],
        "", ON, id="several-calls",
    ),
    pytest.param(
        f"Let me check the weather.\n\n{WEATHER_JSON}",
        "Let me check the weather.", [PARIS], "", ON, id="text-before",
    ),
    pytest.param(
        f"First.\n{WEATHER_JSON}\nThen.\n{WEATHER_BARE}\nDone.",
        "First.\n\nThen.\n\nDone.", [PARIS, ("get_weather", {"city": "Lyon"})], "", ON,
        id="text-between-and-after",
    ),
    pytest.param(
        f"<think>\nThe user wants the weather.\n</think>\n\n{WEATHER_JSON}",
        "", [PARIS], "The user wants the weather.", ON, id="think-then-call",
    ),
    pytest.param(
        f"Thinking about {WEATHER_JSON} here.\n</think>\n\nIt is sunny.",
        "It is sunny.", [], f"Thinking about {WEATHER_JSON} here.",
        {**ON, "think_open": True}, id="think-open-call-in-reasoning-stays-there",
    ),
    pytest.param("<think>r</think>", "", [], "r", ON, id="only-think"),
    pytest.param(
        # Qwen3.5 as its template prompts it: the answer starts inside the think block.
        "I should type these.\n</think>\n\n<tool_call>\n<function=typed>\n"
        "<parameter=count>\n7\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=flag>\ntrue\n</parameter>\n<parameter=options>\n{\"a\": [1, 2]}\n"
        "</parameter>\n<parameter=items>\n[\"x\"]\n</parameter>\n<parameter=text>\n"
        "two\nlines\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n</function>\n"
        "</tool_call>",
        "", [("typed", {"count": 7, "ratio": 0.5, "flag": True, "options": {"a": [1, 2]},
                        "items": ["x"], "text": "two\nlines", "maybe": None})],
        "I should type these.", {**ON, "think_open": True}, id="think-open-then-typed-xml",
    ),
    pytest.param(
        "<tool_call>\n<function=locate>\n<parameter=at>\n{\"x\": 1}\n</parameter>\n"
        "<parameter=unit>\n42\n</parameter>\n</function>\n</tool_call>",
        "", [("locate", {"at": {"x": 1}, "unit": "42"})], "", ON, id="xml-typed-through-refs",
    ),
]


@pytest.mark.parametrize(("text", "content", "calls", "reasoning", "options"), CASES)
def test_recovers_at_every_split(
    text: str, content: str, calls: list[tuple[str, Any]], reasoning: str, options: dict[str, Any]
) -> None:
    assert_recovers(text, content=content, calls=calls, reasoning=reasoning, **options)


RAW_CASES = [
    pytest.param("a < b, c <= d, x<y and <b>bold</b> <tool <thinking", ON, id="less-than"),
    pytest.param(WEATHER_JSON + "\n" + WEATHER_BARE, {}, id="tools-disabled"),
    pytest.param(
        "<think>r</think>x", {**ON, "parse_think": False}, id="think-disabled"
    ),
]


@pytest.mark.parametrize(("text", "options"), RAW_CASES)
def test_text_that_is_not_markup_is_content_verbatim(text: str, options: dict[str, Any]) -> None:
    assert_recovers(text, content=text, calls=[], markup_free=False, **options)


# Markup that does not parse gives its text up as content, without the tags (SPEC 4).
UNRECOVERED_CASES = [
    pytest.param("Try <tool_call>{not json}</tool_call> again.", "Try {not json} again.",
                 id="malformed-json"),
    pytest.param('<tool_call>{"arguments": {}}</tool_call>', '{"arguments": {}}',
                 id="json-without-name"),
    pytest.param('<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
                 '{"name": "a", "arguments": [1]}', id="arguments-not-object"),
    pytest.param('Calling <tool_call>\n{"name": "get_weather", "arguments": {"city": ',
                 'Calling \n{"name": "get_weather", "arguments": {"city": ', id="unclosed-json"),
    pytest.param(f"{WEATHER_JSON[:-5]}",
                 '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
                 id="close-tag-cut-off"),
    pytest.param("<function=f>\n<parameter=x>\n1\n</parameter>\n", "1", id="unclosed-xml"),
    pytest.param("<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>", "\n\nhello",
                 id="bad-xml"),
    pytest.param("<tool_call></tool_call>", "", id="empty-block"),
    pytest.param("Done.</tool_call> Bye.", "Done. Bye.", id="stray-close-tag"),
]


@pytest.mark.parametrize(("text", "content"), UNRECOVERED_CASES)
def test_unrecovered_markup_gives_up_its_text_without_tags(text: str, content: str) -> None:
    assert_recovers(text, content=content, calls=[], **ON)


def test_tools_disabled_still_separates_think() -> None:
    text = f"<think>plan</think>\n{WEATHER_JSON}"
    assert_recovers(text, content=WEATHER_JSON, calls=[], reasoning="plan", markup_free=False)


def test_prose_mentioning_a_tag_does_not_hide_a_later_call() -> None:
    text = f"Use <tool_call> tags, or <function=name> ones. {WEATHER_JSON}"
    assert_recovers(text, content="Use  tags, or  ones.", calls=[PARIS], **ON)


def test_malformed_block_then_valid_call() -> None:
    text = f"<tool_call>{{oops}}</tool_call>\n{WEATHER_JSON}"
    assert_recovers(text, content="{oops}", calls=[PARIS], **ON)


BROKEN_THEN_VALID = [
    pytest.param(
        '<tool_call>{"name": "a", "arguments": {'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
        '{"name": "a", "arguments": {', [("b", {"x": 1})], id="json",
    ),
    pytest.param(
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": \n'
        f"{WEATHER_JSON}\nDone.",
        'Sure.\n\n{"name": "a", "arguments": {"x": \n\nDone.', [PARIS],
        id="json-text-around",
    ),
    pytest.param(
        '<tool_call>{"name": "a", "arguments": {<tool_call>{"name": "a"'
        f"<tool_call>{{oops}}{WEATHER_JSON}",
        '{"name": "a", "arguments": {{"name": "a"{oops}',
        [PARIS], id="json-several-broken",
    ),
    pytest.param(
        f'<tool_call>{{"name": "a", "arguments": {{{WEATHER_BARE}</tool_call>',
        '{"name": "a", "arguments": {',
        [("get_weather", {"city": "Lyon"})], id="json-then-bare-xml",
    ),
    pytest.param(
        "<tool_call>\n<function=a>\nbad\n<tool_call>\n<function=b>\n<parameter=y>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        "\n\nbad", [("b", {"y": "2"})], id="xml-wrapped",
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), BROKEN_THEN_VALID)
def test_unclosed_block_does_not_swallow_the_next_call(
    text: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    """A block that never closes is closed by the next call's close tag; the broken
    opening's text is content (without its tags) and the call after it is recovered."""
    assert_recovers(text, content=content, calls=calls, **ON)


def test_xml_values_are_typed_by_schema() -> None:
    values = {
        "count": "7", "ratio": "2.5", "whole": "3", "flag": "True", "off": "false", "one": "1",
        "options": '{"deep": [1, 2]}', "items": "[1, \"two\"]", "broken": "{oops",
        "text": "  spaced out  ", "bad_count": "seven", "maybe": "null", "either": "12",
        "undeclared": "42",
    }
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=typed>\n{parameters}</function>\n</tool_call>"
    expected = {
        "count": 7, "ratio": 2.5, "whole": 3, "flag": True, "off": False, "one": True,
        "options": {"deep": [1, 2]}, "items": [1, "two"], "broken": "{oops",
        "text": "  spaced out  ", "bad_count": "seven", "maybe": None, "either": 12,
        "undeclared": "42",
    }
    assert_recovers(text, content="", calls=[("typed", expected)], **ON)


def test_xml_strips_one_newline_only() -> None:
    text = "<function=get_weather><parameter=city>\n\nParis\n\n</parameter></function>"
    assert_recovers(text, content="", calls=[("get_weather", {"city": "\nParis\n"})], **ON)


def test_xml_without_tools_keeps_strings() -> None:
    text = "<function=f><parameter=n>5</parameter></function>"
    assert_recovers(text, content="", calls=[("f", {"n": "5"})], parse_tools=True)


def test_think_open_answer() -> None:
    text = "The user greets me.\n</think>\n\nHello!"
    assert_recovers(
        text, content="Hello!", calls=[], reasoning="The user greets me.", think_open=True
    )


def test_think_open_never_closed_is_all_reasoning() -> None:
    assert_recovers("still thinking </thi", content="", calls=[],
                    reasoning="still thinking </thi", think_open=True)


def _content_so_far(parser: StreamParser, *chunks: str) -> str:
    deltas = [delta for chunk in chunks for delta in parser.feed(chunk)]
    return "".join(d.text for d in deltas if isinstance(d, ContentDelta))


def test_possible_tag_is_held_back_until_told_apart() -> None:
    parser = StreamParser(**ON)
    assert _content_so_far(parser, "Hi <", "tool", "_ca") == "Hi"
    assert _content_so_far(parser, "ll>") == ""
    assert _content_so_far(parser, '{"name": "a"}</tool_call>') == ""
    assert [c.name for c in parser.tool_calls] == ["a"]


def test_plain_less_than_is_released_before_the_end() -> None:
    parser = StreamParser(**ON)
    assert _content_so_far(parser, "a <", " b is true") == "a < b is true"
    parser = StreamParser(**ON)
    assert _content_so_far(parser, "see <tool", "s> list") == "see <tools> list"


def test_prose_tag_is_released_before_the_end() -> None:
    parser = StreamParser(**ON)
    assert _content_so_far(parser, "the <tool_call>", " tag is") == "the  tag is"


def test_completion_whitespace_is_not_held() -> None:
    # A chat answer holds trailing whitespace (it is dropped before markup); a
    # completion has no markup, so a newline reaches the client with its own token.
    chat = StreamParser(**ON)
    assert _content_so_far(chat, "Hello", "\n") == "Hello"
    completion = StreamParser(parse_think=False)
    assert _content_so_far(completion, "Hello", "\n") == "Hello\n"
    assert _content_so_far(completion, "  ") == "  "
    assert completion.finish() == []


def test_call_starts_before_the_next_text_arrives() -> None:
    parser = StreamParser(**ON)
    deltas = parser.feed(WEATHER_JSON)
    assert [type(d) for d in deltas] == [ToolCallStart, ToolCallArguments]


def test_plugin_format_is_used() -> None:
    pipes = JsonToolFormat(name="pipes", open_tag="<|tool|>", close_tag="<|/tool|>")
    text = 'Sure.<|tool|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool|>'
    assert_recovers(text, content="Sure.", calls=[PARIS], markup_free=False,
                    formats=[pipes], **ON)


class BrokenFormat:
    name = "broken"
    open_tags = ("<tool_call>",)
    close_tags = inner_tags = ()

    def block_end(self, text: str) -> int | None:
        if len(text) > 20:
            raise RuntimeError("scan bug")
        return None

    def parse(self, block: str, tools: Any) -> list[tuple[str, dict[str, Any]]] | None:
        raise RuntimeError("parse bug")


class ClosesAtOnce(BrokenFormat):
    def block_end(self, text: str) -> int | None:
        return len(text)


@pytest.mark.parametrize("broken", [BrokenFormat(), ClosesAtOnce()], ids=["scan", "parse"])
def test_broken_plugin_format_costs_nothing(broken: BrokenFormat) -> None:
    formats = [broken, *BUILTIN_TOOL_FORMATS]
    assert_recovers(f"ok {WEATHER_JSON}", content="ok", calls=[PARIS], formats=formats, **ON)


def test_builtin_formats_answer_not_a_block_for_prose() -> None:
    for fmt in BUILTIN_TOOL_FORMATS:
        for tag in fmt.open_tags:
            assert fmt.block_end(tag + " is a tag") == NOT_A_BLOCK


FRAGMENTS = [
    "<", ">", "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=f>",
    "</function>", "<parameter=p>", "</parameter>", "<tool", "</", "{", "}", "[", "]",
    '"name"', '"arguments"', ":", ",", '"f"', "1", "a", " ", "\n", "é",
]


@pytest.mark.parametrize("think_open", [False, True])
def test_random_markup_never_raises_and_ignores_chunking(think_open: bool) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        options = {**ON, "think_open": think_open}
        whole = run([text], **options)
        assert run(list(text), **options) == whole, text
        for chunks in list(splits(text, seed=rng.randint(0, 10**6)))[-8:]:
            assert run(chunks, **options) == whole, chunks


def test_parse_message_calls_only() -> None:
    message = parse_message(f"\n{WEATHER_JSON}\n", **ON)
    assert message.content is None and message.reasoning is None
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [PARIS]
    assert message.tool_calls[0].id.startswith("call_")


def test_parse_message_text_think_and_call() -> None:
    message = parse_message(f"<think>\nplan\n</think>\n\nChecking.\n{WEATHER_XML}", **ON)
    assert message.content == "Checking."
    assert message.reasoning == "plan"
    assert [c.name for c in message.tool_calls] == ["get_weather"]


def test_parse_message_plain_text_is_verbatim() -> None:
    assert parse_message("  Hello, a < b.\n", **ON) == ParsedMessage(
        content="  Hello, a < b.\n", reasoning=None, tool_calls=[]
    )


def test_parse_message_keeps_empty_content_without_calls() -> None:
    assert parse_message("<think>only</think>") == ParsedMessage(
        content="", reasoning="only", tool_calls=[]
    )


def test_parse_message_ids_are_unique() -> None:
    message = parse_message(WEATHER_JSON * 5, **ON)
    assert len({c.id for c in message.tool_calls}) == 5
