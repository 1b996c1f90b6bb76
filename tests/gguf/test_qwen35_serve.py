"""The GGUF back end serves the tiny Qwen3.5 and Qwen3.5-MoE GGUFs (F16 and llama.cpp's
Q8_0 / Q4_0 copies) through a real ``butter serve`` and the official openai client.

Random weights: the tests hold the answer's shape (finish reason, usage, streaming) and
that greedy decoding repeats itself, not its words."""

from __future__ import annotations

import pytest
from conftest import ServerProcess
from support.six_tokens import anthropic_six_tokens, openai_six_tokens

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
        reply, chunks, plain = openai_six_tokens(server, served["id"], MESSAGES)
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
        anthropic_six_tokens(server, served["id"], MESSAGES, reply.usage.prompt_tokens)
    finally:
        server.stop()
