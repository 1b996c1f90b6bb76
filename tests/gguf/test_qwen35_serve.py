"""The GGUF back end serves the tiny Qwen3.5 and Qwen3.5-MoE GGUFs (F16 and llama.cpp's
Q8_0 / Q4_0 copies) through a real ``butter serve`` and the official openai client.

Random weights: the tests hold the answer's shape (finish reason, usage, streaming) and
that greedy decoding repeats itself, not its words."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.mark.parametrize("fixture", ["tiny_qwen35_gguf", "tiny_qwen35_gguf_q8",
                                     "tiny_qwen35_gguf_q4", "tiny_qwen35_moe_gguf",
                                     "tiny_qwen35_moe_gguf_q4"])
def test_a_server_answers_chat_on_the_gguf(request, fixture):
    gguf = request.getfixturevalue(fixture)
    server = ServerProcess("--parallel", "2", model=str(gguf))
    try:
        served = server.models()[0]
        architecture = "qwen35moe" if "moe" in fixture else "qwen35"
        assert served["butter"]["backend"] == "gguf"
        assert served["butter"]["architecture"] == architecture
        assert served["butter"]["n_ctx_train"] == 262144
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                               timeout=120)

        def plain():
            return client.chat.completions.create(model=served["id"], messages=MESSAGES,
                                                  max_tokens=6, temperature=0)

        def streamed():
            return list(client.chat.completions.create(
                model=served["id"], messages=MESSAGES, max_tokens=6, temperature=0,
                stream=True, stream_options={"include_usage": True}))

        with ThreadPoolExecutor(2) as pool:  # two sessions at once on a hybrid model
            reply, chunks = (f.result() for f in (pool.submit(plain), pool.submit(streamed)))
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 6
        assert reply.usage.prompt_tokens > 5
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
        # Thinking is on by default: the template opens the think block itself, so a
        # random model's words are reasoning; streamed or not, they are the same words.
        said = reply.choices[0].message.model_dump()
        text = (said.get("reasoning_content") or "") + (said.get("content") or "")
        streamed_text = "".join(
            (c.choices[0].delta.model_dump().get("reasoning_content") or "")
            + (c.choices[0].delta.content or "") for c in chunks if c.choices)
        assert text and streamed_text == text
        again = plain()
        assert again.choices[0].message.model_dump() == said
        message = anthropic.Anthropic(base_url=server.root, api_key="x", max_retries=0,
                                      timeout=120).messages.create(
            model=served["id"], max_tokens=6, messages=MESSAGES)
        assert message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == 6
        read = message.usage.cache_read_input_tokens or 0  # input_tokens counts the rest
        assert message.usage.input_tokens + read == reply.usage.prompt_tokens
    finally:
        server.stop()
