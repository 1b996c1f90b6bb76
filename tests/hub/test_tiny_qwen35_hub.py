"""The design note's first command, in miniature: ``butter serve --model lab/tiny-qwen35``
downloads a Qwen3.5 (hybrid, XML tool calls, thinking on by default) from the loopback
hub and serves every route with both SDKs, streamed and not, tools and thinking included,
on each back end."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from support.qwen35_calls import (
    ANTHROPIC_TOOLS,
    ASK,
    NO_THINKING,
    TOOLS,
    check_typed,
    streamed_calls,
)

HUB_ID = "lab/tiny-qwen35"


@pytest.fixture(scope="session")
def tiny_repo(hub, tiny_qwen35_folder, tiny_qwen35_gguf_q8) -> str:
    """The tiny Qwen3.5 as a hub repository: the HF folder and a Q8_0 GGUF beside it."""
    files = {path.name: path for path in tiny_qwen35_folder.iterdir() if path.is_file()}
    files["Qwen3.5-tiny-Q8_0.gguf"] = tiny_qwen35_gguf_q8
    hub.add(HUB_ID, files)
    return HUB_ID


@pytest.mark.parametrize("backend", ["gguf", pytest.param("mlx", marks=pytest.mark.slow)])
def test_a_hub_qwen35_serves_every_route_with_both_sdks(tiny_repo, hf_env, start_server,
                                                        backend):
    server = start_server("--backend", backend, "--parallel", "2", model=HUB_ID)
    assert httpx.get(f"{server.root}/health").text == "ok"
    card = server.models()[0]
    assert card["id"] == HUB_ID and card["butter"]["backend"] == backend
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=server.root, api_key="x", max_retries=0,
                                 timeout=300)

    # Thinking is on by default: the template opens <think>, the answer is reasoning.
    reply = client.chat.completions.create(model=HUB_ID, messages=ASK, max_tokens=8, seed=1)
    assert reply.choices[0].message.reasoning_content and not reply.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=HUB_ID, messages=ASK, max_tokens=8, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_THINKING))
    assert chunks[-1].usage.prompt_tokens > 0 and chunks[-1].usage.completion_tokens > 0

    # A forced call comes back typed, whole and streamed.
    forced = {"model": HUB_ID, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
              "max_tokens": 200, "seed": 2, "extra_body": NO_THINKING}
    [call] = client.chat.completions.create(**forced).choices[0].message.tool_calls
    check_typed(call.function.name, json.loads(call.function.arguments))
    calls, content, finish = streamed_calls(client.chat.completions.create(stream=True,
                                                                           **forced))
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    check_typed(*calls[0])

    text = client.completions.create(model=HUB_ID, prompt="Once upon a time", max_tokens=4)
    assert text.choices[0].finish_reason in ("length", "stop")

    # Anthropic: thinking blocks by default, a forced tool_use, streaming, count_tokens.
    message = claude.messages.create(model=HUB_ID, max_tokens=8, messages=ASK)
    assert [block.type for block in message.content] == ["thinking"]
    tool = {"model": HUB_ID, "max_tokens": 200, "messages": ASK, "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}}
    with claude.messages.stream(**tool) as stream:
        final = stream.get_final_message()
    [use] = [block for block in final.content if block.type == "tool_use"]
    check_typed(use.name, use.input)
    counted = claude.messages.count_tokens(model=HUB_ID, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens \
        + (message.usage.cache_read_input_tokens or 0)

    metrics = httpx.get(f"{server.root}/metrics").text
    assert "butter_requests_total" in metrics
