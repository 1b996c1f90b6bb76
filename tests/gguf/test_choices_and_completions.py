"""n choices, the legacy /v1/completions route and models.retrieve, through the SDK."""

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The three primary colours are"


def test_models_retrieve_finds_the_resident_model(openai_client):
    card = openai_client.models.retrieve("smollm2")
    assert card.id == "smollm2" and card.owned_by == "butter"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_n_choices_are_the_seeded_answers_side_by_side(openai_client):
    reply = openai_client.chat.completions.create(model="smollm2", messages=QUESTION,
                                                  max_tokens=6, temperature=1.0, seed=11, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    alone = [openai_client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=6, temperature=1.0,
        seed=11 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in reply.choices] == alone
    assert reply.usage.prompt_tokens < 3 * 20  # the prompt counted once
    streamed = openai_client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=6, temperature=1.0, seed=11, n=3,
        stream=True)
    texts = ["", "", ""]
    finished = set()
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == alone and finished == {0, 1, 2}


def test_legacy_completions_continue_a_raw_prompt(openai_client, server):
    reply = openai_client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                             temperature=0)
    text = reply.choices[0].text
    assert reply.object == "text_completion" and text and reply.choices[0].finish_reason
    assert reply.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert streamed == text
    echoed = openai_client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                              temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + text
    default = openai_client.completions.create(model="smollm2", prompt=PROMPT,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the legacy default max_tokens
    several = openai_client.completions.create(model="smollm2", prompt=[PROMPT, "Once upon"],
                                               max_tokens=4, temperature=0, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text  # greedy: same prompt, same text
    bad = httpx.post(f"{server.base_url}/completions",
                     json={"model": "smollm2", "prompt": PROMPT, "suffix": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"


def test_n_choices_share_one_prefill(openai_client, server):
    """The first choice reads the prompt; the others fork its KV and read one token."""
    ask = [{"role": "user", "content": "Name three colours, then three animals, please."}]
    before = server.wait_idle()
    reply = openai_client.chat.completions.create(model="smollm2", messages=ask, max_tokens=4,
                                                  temperature=1.0, seed=5, n=3)
    after = server.wait_idle()
    prompt = reply.usage.prompt_tokens
    prefilled = after["butter_prefill_tokens_total"] - before["butter_prefill_tokens_total"]
    cached = after["butter_cached_tokens_total"] - before["butter_cached_tokens_total"]
    assert prefilled <= prompt + 2 and cached >= 2 * (prompt - 1)
