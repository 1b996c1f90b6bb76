"""Forced calls and thinking on the tiny random-weight Qwen3.5 folder through
``butter serve --backend mlx``: the same grammar, reader and format as on GGUF
(tests/gguf/test_qwen35_tools_e2e.py), on the other back end's tokenizer and sampler."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from conftest import ServerProcess
from support.qwen35_calls import (
    ANTHROPIC_TOOLS,
    ASK,
    NO_THINKING,
    TOOLS,
    check_typed,
    check_xml_written,
    streamed_calls,
)

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request


@pytest.fixture(scope="module")
def mlx_server(tiny_qwen35_folder) -> ServerProcess:
    process = ServerProcess("--backend", "mlx", model=str(tiny_qwen35_folder), timeout=180)
    yield process
    process.stop()


def test_forced_calls_are_typed_xml(mlx_server) -> None:
    client = openai.OpenAI(base_url=mlx_server.base_url, api_key="x", max_retries=0,
                           timeout=180)
    model = mlx_server.models()[0]["id"]
    request = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
               "max_tokens": 200, "seed": 1, "extra_body": NO_THINKING}
    choice = client.chat.completions.create(logprobs=True, **request).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    check_typed(call.function.name, json.loads(call.function.arguments))
    check_xml_written(choice.logprobs, call.function.name)
    calls, content, finish = streamed_calls(client.chat.completions.create(
        stream=True, **{**request, "tool_choice": {"type": "function",
                                                   "function": {"name": "get_time"}}}))
    assert finish == "tool_calls" and content == "" and [c[0] for c in calls] == ["get_time"]
    check_typed(*calls[0])
    message = anthropic.Anthropic(base_url=mlx_server.root, api_key="x", max_retries=0,
                                  timeout=180).messages.create(
        model=model, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"}, thinking={"type": "disabled"})
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    check_typed(use.name, use.input)


def test_answer_starts_inside_the_templates_think_block(mlx_server) -> None:
    client = openai.OpenAI(base_url=mlx_server.base_url, api_key="x", max_retries=0,
                           timeout=180)
    model = mlx_server.models()[0]["id"]
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, seed=3)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length"
    assert message.reasoning_content and not message.content
