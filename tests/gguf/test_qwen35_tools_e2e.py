"""Forced calls and thinking on the tiny random-weight Qwen3.5, through a real `butter serve`.

A random-weight model writes nothing on purpose: every call here is the grammar's doing.
So these tests prove what the grammar and the reader make of the model's own template:
the call comes out in Qwen3-Coder XML (the format Qwen3.5's template teaches), parses,
and carries arguments typed by the tool's schema; an answer to a template that opened
``<think>`` is reasoning; ``enable_thinking: false`` and ``--no-enable-thinking`` give
content. The tools and checks are in ``tests/support/qwen35_calls.py``.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from conftest import ServerProcess
from support.qwen35_calls import (
    ANTHROPIC_TOOLS,
    ASK,
    MARKUP,
    NO_THINKING,
    SCHEMAS,
    TIME,
    TOOLS,
    WEATHER,
    check_typed,
    check_xml_written,
    streamed_calls,
)

MODEL = "Qwen3.5-tiny-F16"  # the GGUF's stem


@pytest.fixture(scope="module")
def tiny_server(tiny_qwen35_gguf) -> ServerProcess:
    process = ServerProcess(model=str(tiny_qwen35_gguf), timeout=120)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.base_url, api_key="x", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def claude(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.root, api_key="x", max_retries=0,
                               timeout=120)


@pytest.mark.parametrize(("tool_choice", "allowed"), [
    ("required", SCHEMAS),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time": TIME}),
])
@pytest.mark.parametrize("seed", [1, 2])
def test_openai_forced_call_is_typed_xml(client, tool_choice, allowed, seed) -> None:
    request = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
               "max_tokens": 200, "seed": seed, "extra_body": NO_THINKING}
    reply = client.chat.completions.create(logprobs=True, **request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls
    check_typed(call.function.name, json.loads(call.function.arguments), allowed)
    check_xml_written(choice.logprobs, call.function.name)
    calls, content, finish = streamed_calls(client.chat.completions.create(stream=True,
                                                                           **request))
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    check_typed(*calls[0], allowed)


@pytest.mark.parametrize(("tool_choice", "allowed"), [
    ({"type": "any"}, SCHEMAS),
    ({"type": "tool", "name": "get_weather"}, {"get_weather": WEATHER}),
])
def test_anthropic_forced_tool_use_is_typed(claude, tool_choice, allowed) -> None:
    request = {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": ANTHROPIC_TOOLS,
               "tool_choice": tool_choice, "thinking": {"type": "disabled"}}
    message = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        final = stream.get_final_message()
    for answer in (message, final):
        assert answer.stop_reason == "tool_use"
        uses = [block for block in answer.content if block.type == "tool_use"]
        assert len(uses) == 1 and uses[0].id.startswith("toolu_")
        check_typed(uses[0].name, uses[0].input, allowed)
        assert not any(tag in block.text for block in answer.content if block.type == "text"
                       for tag in MARKUP)


def test_answer_starts_inside_the_templates_think_block(client, claude) -> None:
    request = {"model": MODEL, "messages": ASK, "max_tokens": 12, "seed": 3}
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length"
    assert message.reasoning_content and not message.content
    chunks = list(client.chat.completions.create(stream=True, **request))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    assert reasoning and not "".join(c.choices[0].delta.content or "" for c in chunks
                                     if c.choices)
    answer = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK)
    assert answer.stop_reason == "max_tokens"
    assert [block.type for block in answer.content] == ["thinking"]


def test_thinking_off_answers_in_content(client, claude) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, seed=3,
                                           extra_body=NO_THINKING)
    message = reply.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None
    answer = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK,
                                    thinking={"type": "disabled"})
    assert [block.type for block in answer.content] == ["text"]


def test_no_enable_thinking_flag(tiny_qwen35_gguf) -> None:
    process = ServerProcess("--no-enable-thinking", model=str(tiny_qwen35_gguf), timeout=120)
    try:
        client = openai.OpenAI(base_url=process.base_url, api_key="x", max_retries=0)
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                               seed=3).choices[0].message
        assert plain.content and getattr(plain, "reasoning_content", None) is None
        thinking = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=12, seed=3,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
        assert thinking.reasoning_content and not thinking.content  # the request wins
        forced = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                tool_choice="required", max_tokens=200)
        [call] = forced.choices[0].message.tool_calls
        check_typed(call.function.name, json.loads(call.function.arguments))
    finally:
        process.stop()


def test_tool_rounds_resend_calls_and_results(client, claude) -> None:
    """A call and its result go back through Qwen3.5's template (which writes the call's
    arguments as XML parameters) and the next forced call is typed again."""
    messages = list(ASK)
    for round_ in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
            max_tokens=200, seed=round_, extra_body=NO_THINKING)
        [call] = reply.choices[0].message.tool_calls
        check_typed(call.function.name, json.loads(call.function.arguments))
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C."}]
    assert reply.usage.prompt_tokens > 200
    history: list[dict] = [{"role": "user", "content": ASK[0]["content"]}]
    for _ in range(2):
        answer = claude.messages.create(model=MODEL, max_tokens=200, messages=history,
                                        tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                        thinking={"type": "disabled"})
        [use] = [block for block in answer.content if block.type == "tool_use"]
        check_typed(use.name, use.input)
        history += [{"role": "assistant", "content": [block.model_dump() for block in
                                                      answer.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "Sunny."}]}]
