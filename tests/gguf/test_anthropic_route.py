"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` with the official ``anthropic`` SDK.

First against a real ``butter serve`` on SmolLM2; then in-process against the scripted
back end, for answers the real model will not give on demand (a think block, two
calls, an engine failure halfway through a stream).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from fakes.scripted import Reply, ScriptedBackend
from support.anthropic_blocks import blocks_of

from butter.errors import InternalError
from butter.http.app import create_app

MODEL = "smollm2"
GREEDY = {"temperature": 0}  # the SDK no longer has a `temperature` argument
USER = [{"role": "user", "content": "Tell me about Paris."}]
ONE_WORD = "What is the capital of France? Answer in one word."
BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    # The SDK appends /v1/messages itself, so the base URL is the bare server.
    return anthropic.Anthropic(base_url=server.root, api_key="x", max_retries=0, timeout=120)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def assert_event_order(types: list[str], blocks: int = 1) -> None:
    """message_start, then each block's start, deltas and stop, then the end."""
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    body = types[1:-2]
    for _ in range(blocks):
        assert body[0] == "content_block_start"
        stop = body.index("content_block_stop")
        assert stop > 1 and set(body[1:stop]) == {"content_block_delta"}
        body = body[stop + 1:]
    assert body == []


# ---- against the real server -----------------------------------------------------------


def test_message(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=200, system="Answer briefly.",
                                     messages=[{"role": "user", "content": "What is 2+2?"}],
                                     extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message).strip()
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert 0 < message.usage.output_tokens < 200
    assert message.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(
        model=MODEL, system="Answer briefly.",
        messages=[{"role": "user", "content": "What is 2+2?"}],
    ).input_tokens
    # Anthropic's accounting: the prompt is the new input plus what the cache held.
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted


def test_max_tokens_stop_reason(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=3, messages=USER,
                                     extra_body=GREEDY)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3
    assert text_of(message)


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=64, messages=USER,
                                      stop_sequences=["e"], extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "e"
    assert "e" not in text_of(message)
    assert message.usage.output_tokens < 64


def test_stream_helper(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=12, messages=USER,
                                system=[{"type": "text", "text": "Be brief."}],
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [event.type for event in events if event.type not in ("text",)]
    assert_event_order(raw)
    text = "".join(event.text for event in events if event.type == "text")
    assert text and text == text_of(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    start = events[0].message
    assert start.content == [] and start.usage.input_tokens > 0
    assert final.id == start.id


def test_create_stream_events(client: anthropic.Anthropic) -> None:
    events = list(client.messages.create(model=MODEL, max_tokens=200, stream=True,
                                         messages=[{"role": "user", "content": ONE_WORD}],
                                         extra_body=GREEDY))
    assert_event_order([event.type for event in events])
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in deltas)
    assert "".join(e.delta.text for e in deltas).strip()
    end = events[-2]
    assert end.delta.stop_reason == "end_turn" and end.delta.stop_sequence is None
    assert len(deltas) <= end.usage.output_tokens < 200


def test_raw_sse_framing(server) -> None:
    # Every event is an `event:` line naming the data's type, then its `data:` line.
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": USER}
    with httpx.stream("POST", f"{server.root}/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = response.read().decode().strip().split("\n\n")
    names = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        name = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert_event_order(names)


def test_system_as_string_or_blocks(client: anthropic.Anthropic) -> None:
    def count(**system: Any) -> int:
        return client.messages.count_tokens(model=MODEL, messages=USER, **system).input_tokens

    plain = count(system="You are a pirate. Answer like one.")
    blocks = count(system=[{"type": "text", "text": "You are a pirate. "},
                           {"type": "text", "text": "Answer like one."}])
    assert plain == blocks
    assert count() != plain  # without a system prompt the template writes its own
    message = client.messages.create(
        model=MODEL, max_tokens=8, messages=USER, extra_body=GREEDY,
        system=[{"type": "text", "text": "You are a pirate. Answer like one."}],
    )
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == blocks


def test_count_tokens_counts_tools(client: anthropic.Anthropic) -> None:
    tool = {"name": "get_weather", "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    bare = client.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=USER,
                                              tools=[tool]).input_tokens
    assert 0 < bare < with_tools


def assert_anthropic_error(body: Any, kind: str) -> None:
    assert body["type"] == "error"
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert set(body["error"]) == {"type", "message"}


def test_errors_have_anthropic_shape_and_the_server_keeps_serving(
        client: anthropic.Anthropic, server) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", cast_to=httpx2.Response,
                    body={"model": MODEL, "messages": USER})
    assert caught.value.status_code == 400
    assert_anthropic_error(caught.value.body, "invalid_request_error")
    assert "max_tokens" in caught.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=USER,
                               extra_body={"temperature": 1.5})
    assert_anthropic_error(caught.value.body, "invalid_request_error")

    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model-anywhere", max_tokens=4, messages=USER)
    assert_anthropic_error(caught.value.body, "not_found_error")

    for raw in (b'{"model": "smollm2", "max_tokens": 4, "messages": [', b"", b"[1, 2]"):
        response = httpx.post(f"{server.root}/v1/messages", content=raw, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert_anthropic_error(response.json(), "invalid_request_error")
    response = httpx.post(f"{server.root}/v1/messages/count_tokens", content=b"{", timeout=30)
    assert response.status_code == 400
    assert_anthropic_error(response.json(), "invalid_request_error")

    # Headers of Anthropic's API (and a bearer token) are ignored, and it still answers.
    response = httpx.post(
        f"{server.root}/v1/messages", timeout=60,
        headers={"anthropic-version": "2023-06-01", "x-api-key": "sk-ant-whatever",
                 "Authorization": "Bearer nothing"},
        json={"model": MODEL, "max_tokens": 4, "messages": USER},
    )
    assert response.status_code == 200
    assert response.json()["content"][0]["text"]
    assert server.wait_idle()["butter_active_requests"] == 0


# ---- in-process, scripted answers ------------------------------------------------------

THINK_AND_CALLS = (
    "<think>\nThe user wants weather and time.\n</think>\n\nLet me look both up. "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
TOOLS = [
    {"name": "get_weather", "input_schema": {"type": "object",
                                             "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "input_schema": {"type": "object",
                                          "properties": {"zone": {"type": "string"}}}},
]


def scripted_client(backend: ScriptedBackend) -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=create_app(backend))
    return anthropic.AsyncAnthropic(base_url="http://butter.test", api_key="x", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))


async def test_thinking_text_and_two_calls_stream_and_not() -> None:
    backend = ScriptedBackend([THINK_AND_CALLS, THINK_AND_CALLS])
    client = scripted_client(backend)
    request = {"model": "scripted", "max_tokens": 200, "messages": USER, "tools": TOOLS}
    message = await client.messages.create(**request)
    expected = [("thinking", "The user wants weather and time."),
                ("text", "Let me look both up."),
                ("tool_use", ("get_weather", {"city": "Zürich"})),
                ("tool_use", ("get_time", {"zone": "CET"}))]
    assert blocks_of(message) == expected
    assert message.stop_reason == "tool_use"
    assert message.content[0].signature == ""

    async with client.messages.stream(**request) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    raw = [e for e in events if e.type in ("message_start", *BLOCK_EVENTS, "message_delta",
                                            "message_stop")]
    assert_event_order([e.type for e in raw], blocks=4)
    assert [e.delta.type for e in raw if e.type == "content_block_delta"][0] == "thinking_delta"
    assert {e.delta.type for e in raw if e.type == "content_block_delta"} == {
        "thinking_delta", "text_delta", "input_json_delta"}
    assert blocks_of(final) == expected
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == message.usage.output_tokens > 0


async def test_stop_sequence_and_max_tokens_scripted() -> None:
    backend = ScriptedBackend(["Hello END there", "one two three four five six"])
    client = scripted_client(backend)
    message = await client.messages.create(model="scripted", max_tokens=50, messages=USER,
                                           stop_sequences=["never", "END"])
    assert (text_of(message), message.stop_reason, message.stop_sequence) == \
        ("Hello ", "stop_sequence", "END")
    message = await client.messages.create(model="scripted", max_tokens=3, messages=USER)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 3)
    assert text_of(message) == "one two three"


async def test_tool_result_round_trip_reaches_the_prompt() -> None:
    backend = ScriptedBackend([
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "It is sunny in Paris.",
    ])
    client = scripted_client(backend)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = await client.messages.create(model="scripted", max_tokens=100, messages=messages,
                                         tools=TOOLS)
    assert first.stop_reason == "tool_use"
    call = first.content[0]
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                          for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny, 24 C"}]}]},
    ]
    second = await client.messages.create(model="scripted", max_tokens=100, messages=messages,
                                          tools=TOOLS)
    assert text_of(second) == "It is sunny in Paris." and second.stop_reason == "end_turn"
    tool_message = backend.requests[1].messages[-1]
    assert tool_message == {"role": "tool", "content": "Sunny, 24 C", "tool_call_id": call.id}
    prompt = backend.plans[1].text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in prompt


async def test_error_mid_stream_is_an_error_event() -> None:
    backend = ScriptedBackend([Reply("Half an answer", error=InternalError()),
                               Reply("Half an answer", error=InternalError()), "Still here."])
    transport = httpx2.ASGITransport(app=create_app(backend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://butter.test") as http:
        response = await http.post("/v1/messages", json={
            "model": "scripted", "max_tokens": 50, "stream": True, "messages": USER})
    assert response.status_code == 200
    frames = response.text.strip().split("\n\n")
    names = [frame.split("\n")[0].removeprefix("event: ") for frame in frames]
    assert names[0] == "message_start" and names[-1] == "error"
    assert "message_stop" not in names and "message_delta" not in names
    error = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "api_error",
                                                "message": "The server had an internal error."}}

    client = scripted_client(backend)
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(model="scripted", max_tokens=50,
                                          messages=USER) as stream:
            async for _ in stream:
                pass
    assert_anthropic_error(caught.value.body, "api_error")
    message = await client.messages.create(model="scripted", max_tokens=50, messages=USER)
    assert text_of(message) == "Still here."
