"""Anthropic Messages bodies to ChatRequest, and deltas to content blocks and events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from butter.chat.prompt import build_prompt
from butter.chat.recovery import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallStart
from butter.chat.request import ToolChoice
from butter.chat.template import ChatTemplate
from butter.errors import InvalidRequestError
from butter.generation import Usage
from butter.wire.anthropic import (
    MessageBuilder,
    parse_messages_request,
    stop_reason,
    tool_use_id,
    usage_body,
)

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
            **fields}


def rejects(fields: dict[str, Any], param: str, *, for_count: bool = False) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        parse_messages_request(fields, for_count=for_count)
    assert caught.value.param == param
    assert caught.value.status_code == 400
    return caught.value.message


# ---- request translation ---------------------------------------------------------------


def test_plain_request() -> None:
    chat = parse_messages_request(body(temperature=0.2, top_p=0.5, stop_sequences=["END", ""],
                                       stream=True, metadata={"user_id": "u"}, top_k=5))
    assert chat.messages == [{"role": "user", "content": "Hi"}]
    assert chat.model == "m" and chat.stream
    assert chat.params.max_tokens == 64
    assert chat.params.temperature == 0.2 and chat.params.top_p == 0.5
    assert chat.params.stop == ("END",)
    assert chat.tools == [] and chat.tool_choice == ToolChoice()
    assert not chat.wants_tools


@pytest.mark.parametrize("system", ["Be brief.", [{"type": "text", "text": "Be "},
                                                  {"type": "text", "text": "brief.",
                                                   "cache_control": {"type": "ephemeral"}}]])
def test_system_string_or_text_blocks(system: Any) -> None:
    chat = parse_messages_request(body(system=system))
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat.messages[1]["role"] == "user"


@pytest.mark.parametrize("system", ["", []])
def test_empty_system_adds_no_message(system: Any) -> None:
    chat = parse_messages_request(body(system=system))
    assert [m["role"] for m in chat.messages] == ["user"]


def test_content_blocks_and_a_tool_round_trip() -> None:
    chat = parse_messages_request(body(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                         {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                 "input": {"city": "Lyon"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "Rain"}]},
                {"type": "text", "text": "Which is warmer?"},
            ]},
        ],
    ))
    assert chat.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.",
         "reasoning_content": "I should call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
        ]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Rain", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Which is warmer?"},
    ]
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": WEATHER["input_schema"]}}]
    assert chat.wants_tools


def test_tool_result_variants() -> None:
    chat = parse_messages_request(body(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t"},
            {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True},
        ]},
    ]))
    assert chat.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": {}}}]}
    assert chat.messages[2:] == [
        {"role": "tool", "content": "", "tool_call_id": "t"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "t"},
    ]


def test_translated_history_renders_through_a_template_without_tools() -> None:
    chat = parse_messages_request(body(
        system="You help.", tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "Sunny, 22 C"}]},
        ],
    ))
    text = build_prompt(chat, ChatTemplate(None)).text  # ChatML, knows nothing of tools
    assert text.startswith("<|im_start|>system\nYou help.\n\n") and "<tools>" in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in text
    assert "<|im_start|>user\n<tool_response>\nSunny, 22 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, ToolChoice("auto")),
    ({"type": "any"}, ToolChoice("required")),
    ({"type": "none"}, ToolChoice("none")),
    ({"type": "tool", "name": "get_weather"}, ToolChoice("function", "get_weather")),
    ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice("auto")),
])
def test_tool_choice(choice: dict[str, Any], expected: ToolChoice) -> None:
    chat = parse_messages_request(body(tools=[WEATHER], tool_choice=choice))
    assert chat.tool_choice == expected
    assert chat.wants_tools == (expected.mode != "none")


def test_forced_tool_choice_opens_the_call() -> None:
    chat = parse_messages_request(body(tools=[WEATHER],
                                       tool_choice={"type": "tool", "name": "get_weather"}))
    plan = build_prompt(chat, ChatTemplate(None))
    assert plan.answer_prefix == "<tool_call>\n"  # the grammar holds the rest of the call


@pytest.mark.parametrize(("thinking", "expected"), [
    (None, None), ({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "disabled"}, False),
])
def test_thinking(thinking: Any, expected: bool | None) -> None:
    fields = body() if thinking is None else body(thinking=thinking)
    assert parse_messages_request(fields).enable_thinking is expected


def test_count_tokens_body_needs_no_max_tokens() -> None:
    fields = body()
    del fields["max_tokens"]
    chat = parse_messages_request(fields, for_count=True)
    assert chat.params.max_tokens is None and not chat.stream


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens="10"), "max_tokens"),
    (body(messages=[]), "messages"),
    ({"max_tokens": 5}, "messages"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (body(messages=["hi"]), "messages[0]"),
    (body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0]"),
    (body(messages=[{"role": "user", "content": [{"text": "no type"}]}]),
     "messages[0].content[0]"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_result",
                                                       "tool_use_id": "t"}]}]),
     "messages[0].content[0]"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "messages[0].content[0].tool_use_id"),
    (body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t",
         "content": [{"type": "image", "source": {}}]}]}]),
     "messages[0].content[0].content"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                       "name": "f", "input": "x"}]}]),
     "messages[0].content[0].input"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]),
     "messages[0].content[0].id"),
    (body(system=5), "system"),
    (body(temperature=1.5), "temperature"),
    (body(temperature="hot"), "temperature"),
    (body(stream="yes"), "stream"),
    (body(stop_sequences=[1]), "stop_sequences"),
    (body(tools={"name": "f"}), "tools"),
    (body(tools=[{"name": "f"}]), "tools[0]"),
    (body(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0]"),
    (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (body(tools=[WEATHER], tool_choice="auto"), "tool_choice"),
    (body(thinking={"type": "sometimes"}), "thinking"),
    (body(model=3), "model"),
])
def test_invalid_bodies_name_the_field(fields: dict[str, Any], param: str) -> None:
    rejects(fields, param)


def test_missing_max_tokens_message() -> None:
    fields = body()
    del fields["max_tokens"]
    assert "max_tokens" in rejects(fields, "max_tokens")


# ---- response builders -----------------------------------------------------------------


@pytest.mark.parametrize(("finish", "stop", "expected"), [
    ("stop", None, "end_turn"),
    ("stop", "END", "stop_sequence"),
    ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use"),
    ("tool_calls", "END", "tool_use"),
    (None, None, "end_turn"),
])
def test_stop_reason(finish: str | None, stop: str | None, expected: str) -> None:
    assert stop_reason(finish, stop) == expected


def test_usage_splits_cached_input() -> None:
    assert usage_body(Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=60)) == {
        "input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 0,
    }


def test_tool_use_ids() -> None:
    assert tool_use_id("call_0123abcd") == "toolu_0123abcd"


DELTAS = [
    ReasoningDelta("Weather, "), ReasoningDelta("so call."),
    ContentDelta("Checking"), ContentDelta(" now."),
    ToolCallStart(0, "call_aa", "get_weather"), ToolCallArguments(0, '{"city": "Paris"}'),
    ToolCallStart(1, "call_bb", "get_time"), ToolCallArguments(1, '{"zone": '),
    ToolCallArguments(1, '"UTC"}'),
    ContentDelta("Done."),
]
BLOCKS = [
    {"type": "thinking", "thinking": "Weather, so call.", "signature": ""},
    {"type": "text", "text": "Checking now."},
    {"type": "tool_use", "id": "toolu_aa", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "toolu_bb", "name": "get_time", "input": {"zone": "UTC"}},
    {"type": "text", "text": "Done."},
]
END = {"finish_reason": "tool_calls", "stop_sequence": None, "usage": Usage(50, 20, 30)}


def test_message_body() -> None:
    builder = MessageBuilder(message_id="msg_1", model="m")
    for delta in DELTAS:
        builder.add(delta)
    assert builder.message(**END) == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": BLOCKS, "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 20, "cache_read_input_tokens": 30,
                  "cache_creation_input_tokens": 0},
    }


def test_stream_events_in_order() -> None:
    builder = MessageBuilder(message_id="msg_1", model="m")
    events = builder.start(50)
    for delta in DELTAS:
        events += builder.add(delta)
    events += builder.finish(**END)

    def kinds(name: str, data: dict[str, Any]) -> str:
        assert data["type"] == name  # the SSE event name repeats the data's type
        detail = data.get("delta", data.get("content_block", {})).get("type", "")
        return f"{name}:{data.get('index', '')}:{detail}".rstrip(":")

    assert [kinds(*event) for event in events] == [
        "message_start",
        "content_block_start:0:thinking",
        "content_block_delta:0:thinking_delta", "content_block_delta:0:thinking_delta",
        "content_block_stop:0",
        "content_block_start:1:text",
        "content_block_delta:1:text_delta", "content_block_delta:1:text_delta",
        "content_block_stop:1",
        "content_block_start:2:tool_use", "content_block_delta:2:input_json_delta",
        "content_block_stop:2",
        "content_block_start:3:tool_use", "content_block_delta:3:input_json_delta",
        "content_block_delta:3:input_json_delta", "content_block_stop:3",
        "content_block_start:4:text", "content_block_delta:4:text_delta",
        "content_block_stop:4",
        "message_delta", "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 50 and start["usage"]["output_tokens"] == 0
    assert events[-2][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": usage_body(END["usage"])}
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "",
                                              "signature": ""}
    assert events[9][1]["content_block"] == {"type": "tool_use", "id": "toolu_aa",
                                              "name": "get_weather", "input": {}}
    # Replaying the events the way a client accumulates them gives the same blocks.
    assert accumulate(events) == BLOCKS


def accumulate(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[key] += delta[key]
        elif name == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
    return blocks


def test_blank_text_makes_no_block() -> None:
    builder = MessageBuilder(message_id="msg_1", model="m")
    events = []
    for delta in [ContentDelta("\n"), ContentDelta(" "), ToolCallStart(0, "call_a", "f"),
                  ToolCallArguments(0, "{}"), ReasoningDelta("\n"), ContentDelta(" "),
                  ContentDelta("\n\nHi"), ContentDelta(" \n")]:
        events += builder.add(delta)
    message = builder.message(finish_reason="tool_calls", stop_sequence=None, usage=None)
    assert message["content"] == [
        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
        {"type": "text", "text": " \n\nHi \n"},
    ]
    assert [name for name, _ in events].count("content_block_start") == 2


def test_nothing_generated_is_an_empty_message() -> None:
    builder = MessageBuilder(message_id="msg_1", model="m")
    events = builder.start(5) + builder.add(ContentDelta("  ")) + builder.finish(
        finish_reason="stop", stop_sequence="END", usage=Usage(5, 1, 0))
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    message = builder.message(finish_reason="stop", stop_sequence="END", usage=Usage(5, 1, 0))
    assert message["content"] == [] and message["stop_sequence"] == "END"


def test_stop_sequence_is_only_reported_with_its_reason() -> None:
    builder = MessageBuilder(message_id="msg_1", model="m")
    message = builder.message(finish_reason="length", stop_sequence="END", usage=None)
    assert (message["stop_reason"], message["stop_sequence"]) == ("max_tokens", None)
