"""``/v1/completions`` prompts beyond text, on the real model through the SDK: token
ids, lists of them, and fill-in-the-middle ``suffix`` (a 400 on SmolLM2, whose
vocabulary has no FIM tokens)."""

from __future__ import annotations

import openai
import pytest
from fakes.scripted import real_tokenizer

MODEL = "smollm2"
PROMPT = "The capital of France is"


def test_token_id_prompts_answer_like_their_text(openai_client) -> None:
    ids = real_tokenizer().tokenize(PROMPT)
    text = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                            temperature=0)
    by_ids = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=6,
                                              temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    both = openai_client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4,
                                            temperature=0, stream=True)
    indexes = {c.choices[0].index for c in both if c.choices}
    assert indexes == {0, 1}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [10**6]}, "prompt"),  # past the vocabulary
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 2], "echo": True}, "echo"),
    ({"prompt": PROMPT, "suffix": " and that is all."}, "suffix"),  # no FIM tokens
    ({"prompt": [1, 2], "suffix": "x"}, "suffix"),
])
def test_prompts_it_cannot_take_are_400s(openai_client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, max_tokens=2, **body)
    assert info.value.body["param"] == param
    assert openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
