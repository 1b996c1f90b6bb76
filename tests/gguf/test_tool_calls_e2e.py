"""Tool calls end to end: SmolLM2 behind a real server, both SDKs, both routes.

SmolLM2-135M does not call tools on its own, but it copies text it is told to copy,
markup included, so each test asks it to repeat a ``<tool_call>`` block. Greedy
sampling and a few phrasings keep a test from hanging on one lucky sample: a test
needs one phrasing to yield a call, and every answer that holds a call must have
the properties a client relies on (structured calls, no markup left in the text,
the tool-calls finish reason, arguments that are a JSON object).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import anthropic
import pytest

T = TypeVar("T")

MODEL = "smollm2"
SYSTEM = "You copy text exactly."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PROMPTS = [
    "Repeat the following text exactly, with nothing before or after it:\n" + CALL,
    "Copy this text exactly, with nothing before or after it:\n" + CALL,
    "Output the following text exactly and nothing else:\n\n" + CALL,
]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city", "parameters": PARAMETERS,
}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the weather for a city",
                    "input_schema": PARAMETERS}]
RESULT = "Sunny, 22 degrees Celsius."
EXPECTED = ("get_weather", {"city": "Paris"})


def first_call(attempt: Callable[[str, int], T | None]) -> T:
    """Run ``attempt(prompt, seed)`` per phrasing until one yields a call (its checks
    run inside ``attempt``, on every answer that holds one)."""
    for seed, prompt in enumerate(PROMPTS, start=1):
        result = attempt(prompt, seed)
        if result is not None:
            return result
    pytest.fail("no phrasing made the model write a tool call")


def openai_messages(prompt: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


# ---- OpenAI route ----------------------------------------------------------------------


def check_openai_call(response: Any) -> Any | None:
    """The response's message if it holds calls, after checking what a client needs."""
    choice = response.choices[0]
    message = choice.message
    assert "<tool_call" not in (message.content or "")
    if not message.tool_calls:
        assert choice.finish_reason in ("stop", "length")
        return None
    assert choice.finish_reason == "tool_calls"
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert isinstance(json.loads(call.function.arguments), dict)
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    return message


def as_pairs(calls: Any) -> list[tuple[str, Any]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in calls]


@pytest.mark.parametrize("tool_choice", [
    "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
])
def test_openai_call(openai_client, tool_choice: Any) -> None:
    def attempt(prompt: str, seed: int) -> Any:
        return check_openai_call(openai_client.chat.completions.create(
            model=MODEL, messages=openai_messages(prompt), tools=OPENAI_TOOLS,
            tool_choice=tool_choice, temperature=0, seed=seed, max_tokens=80,
        ))

    message = first_call(attempt)
    assert as_pairs(message.tool_calls)[0][1]  # a forced call still got its arguments
    if tool_choice != "auto":
        # The forced opening (see prompt.py) makes even this model's first try count.
        assert as_pairs(message.tool_calls) == [EXPECTED]


def test_openai_tool_choice_none_leaves_markup_as_text(openai_client) -> None:
    def attempt(prompt: str, seed: int) -> str | None:
        response = openai_client.chat.completions.create(
            model=MODEL, messages=openai_messages(prompt), tools=OPENAI_TOOLS,
            tool_choice="none", temperature=0, seed=seed, max_tokens=80,
        )
        choice = response.choices[0]
        assert choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        content = choice.message.content or ""
        return content if "<tool_call>" in content else None

    assert '"name": "get_weather"' in first_call(attempt)


def test_openai_stream_call(openai_client) -> None:
    def attempt(prompt: str, seed: int) -> list[Any] | None:
        chunks = list(openai_client.chat.completions.create(
            model=MODEL, messages=openai_messages(prompt), tools=OPENAI_TOOLS, stream=True,
            temperature=0, seed=seed, max_tokens=80,
        ))
        assert len({chunk.id for chunk in chunks}) == 1
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert not any("<tool_call" in (delta.content or "") for delta in deltas)
        calls = [call for delta in deltas for call in (delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
        if not calls:
            assert finish in ("stop", "length")
            return None
        assert finish == "tool_calls"
        first, rest = calls[0], calls[1:]
        assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
        assert first.function.name and first.function.arguments == ""
        assert rest, "the arguments come after the first delta"
        for later in rest:
            assert later.index == 0  # one call here
            assert later.id is None and later.type is None and later.function.name is None
        arguments = "".join(later.function.arguments for later in rest)
        assert isinstance(json.loads(arguments), dict)
        return [(first.function.name, json.loads(arguments))]

    assert first_call(attempt) == [EXPECTED]


def test_openai_round_trip(openai_client) -> None:
    state: dict[str, Any] = {}

    def attempt(prompt: str, seed: int) -> Any:
        state.update(messages=openai_messages(prompt), seed=seed)
        return check_openai_call(openai_client.chat.completions.create(
            model=MODEL, messages=state["messages"], tools=OPENAI_TOOLS, temperature=0,
            seed=seed, max_tokens=80,
        ))

    message = first_call(attempt)
    messages = [
        *state["messages"],
        message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": call.id, "content": RESULT}
          for call in message.tool_calls),
    ]
    response = openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0, seed=state["seed"],
        max_tokens=100,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content and choice.message.content.strip()
    assert not choice.message.tool_calls
    # The resent stem (system, user turn, tools block) is served from the session.
    assert response.usage.prompt_tokens_details.cached_tokens > 0


# ---- Anthropic route -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key="x", max_retries=0, timeout=120)


def check_anthropic_call(message: Any) -> Any | None:
    for block in message.content:
        if block.type == "text":
            assert "<tool_call" not in block.text
    calls = [block for block in message.content if block.type == "tool_use"]
    if not calls:
        assert message.stop_reason in ("end_turn", "max_tokens")
        return None
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    for call in calls:
        assert call.id.startswith("toolu_") and isinstance(call.input, dict)
    return message


def tool_uses(message: Any) -> list[tuple[str, Any]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("tool_choice", [
    {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"},
])
def test_anthropic_call(client: anthropic.Anthropic, tool_choice: dict[str, Any]) -> None:
    def attempt(prompt: str, seed: int) -> Any:
        return check_anthropic_call(client.messages.create(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": prompt}],
            tools=ANTHROPIC_TOOLS, tool_choice=tool_choice, max_tokens=80,
            extra_body={"temperature": 0, "seed": seed},
        ))

    message = first_call(attempt)
    if tool_choice["type"] != "auto":
        assert tool_uses(message) == [EXPECTED]


def test_anthropic_stream_call(client: anthropic.Anthropic) -> None:
    def attempt(prompt: str, seed: int) -> Any:
        with client.messages.stream(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": prompt}],
            tools=ANTHROPIC_TOOLS, max_tokens=80, extra_body={"temperature": 0, "seed": seed},
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        for event in events:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                assert "<tool" not in event.delta.text
        if check_anthropic_call(final) is None:
            return None
        starts = [e for e in events if e.type == "content_block_start"
                  and e.content_block.type == "tool_use"]
        assert starts and starts[0].content_block.input == {}
        index = starts[0].index
        partial = "".join(e.delta.partial_json for e in events
                          if e.type == "content_block_delta" and e.index == index)
        assert json.loads(partial) == final.content[index].input
        assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == "tool_use"
        return final

    assert tool_uses(first_call(attempt)) == [EXPECTED]


def test_anthropic_round_trip(client: anthropic.Anthropic) -> None:
    state: dict[str, Any] = {}

    def attempt(prompt: str, seed: int) -> Any:
        state.update(messages=[{"role": "user", "content": prompt}], seed=seed)
        return check_anthropic_call(client.messages.create(
            model=MODEL, system=SYSTEM, messages=state["messages"], tools=ANTHROPIC_TOOLS,
            max_tokens=80, extra_body={"temperature": 0, "seed": seed},
        ))

    first = first_call(attempt)
    messages = [
        *state["messages"],
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                          for block in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id,
             "content": [{"type": "text", "text": RESULT}]}
            for block in first.content if block.type == "tool_use"
        ]},
    ]
    second = client.messages.create(model=MODEL, system=SYSTEM, messages=messages,
                                    tools=ANTHROPIC_TOOLS, max_tokens=100,
                                    extra_body={"temperature": 0, "seed": state["seed"]})
    assert second.stop_reason == "end_turn"
    assert "".join(b.text for b in second.content if b.type == "text").strip()
    assert not tool_uses(second)
    assert second.usage.cache_read_input_tokens > 0
