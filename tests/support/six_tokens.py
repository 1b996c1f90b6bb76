"""Six-token answers from a real server through the official openai and anthropic
clients: the shape a user sees (finish reason, usage, streaming), whatever the words."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai


def openai_six_tokens(server, model: str, messages: list[dict[str, Any]]
                      ) -> tuple[Any, list[Any], Callable[[], Any]]:
    """Ask for six greedy tokens plain and streamed at once (two sessions), check the
    finish reasons and usage, and give the reply, the chunks and the plain request."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)

    def plain():
        return client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                              temperature=0)

    def streamed():
        return list(client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}))

    with ThreadPoolExecutor(2) as pool:
        reply, chunks = (f.result() for f in (pool.submit(plain), pool.submit(streamed)))
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    return reply, chunks, plain


def anthropic_six_tokens(server, model: str, messages: list[dict[str, Any]],
                         prompt_tokens: int) -> None:
    """Six tokens through /v1/messages: stopped at max_tokens, and the input tokens
    (cached or not) are the prompt the OpenAI route counted."""
    message = anthropic.Anthropic(base_url=server.root, api_key="x", max_retries=0,
                                  timeout=120).messages.create(
        model=model, max_tokens=6, messages=messages)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 6
    read = message.usage.cache_read_input_tokens or 0  # input_tokens counts the rest
    assert message.usage.input_tokens + read == prompt_tokens
