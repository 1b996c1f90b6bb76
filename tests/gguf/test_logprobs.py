"""Log-probabilities on the real model, through the official SDK: the model's own
distribution (before temperature, penalties and masks), as vLLM and llama-server report."""

from __future__ import annotations

import math

import openai
import pytest

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Name the capital city of France."}]


def check_entries(entries, text: str, top: int) -> None:
    assert "".join(e.token for e in entries) == text
    for entry in entries:
        assert entry.logprob <= 0.0 and bytes(entry.bytes).decode("utf-8", "replace") == \
            entry.token
        assert len(entry.top_logprobs) == top
        # Greedy: the drawn token is the likeliest one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1.0 + 1e-6


def test_chat_logprobs_at_temperature_0(openai_client) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    check_entries(choice.logprobs.content, choice.message.content, 3)
    plain = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                                  temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


def test_chat_logprobs_streamed_with_n(openai_client) -> None:
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        text = "".join(c.delta.content or "" for c in mine)
        entries = [e for c in mine if c.logprobs for e in c.logprobs.content]
        check_entries(entries, text, 2)


def test_legacy_completion_logprobs(openai_client) -> None:
    prompt = "The capital of France is"
    reply = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                             temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    text = reply.choices[0].text
    assert "".join(logprobs.tokens) == text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i]))
                                    for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token and top[token] == logprob
    streamed = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                     temperature=0, logprobs=2, stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
    offsets = [o for c in streamed if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset


def test_top_logprobs_0_gives_the_drawn_token_alone(openai_client) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True, top_logprobs=0)
    entries = reply.choices[0].logprobs.content
    assert entries and all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("legacy", {"logprobs": 6}, "logprobs"),
    ("legacy", {"logprobs": 1, "echo": True}, "echo"),
])
def test_logprobs_out_of_range_is_a_400(openai_client, route, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                                  extra_body=body)
        else:
            openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                             extra_body=body)
    assert info.value.body["param"] == param
