"""Prompt-lookup speculation on the MLX back end (SmolLM2 from the shipped GGUF): the
same tokens as without it, alone, beside another request and again (SPEC 5).

A verify is one pass of the session's own caches over the last token and its drafts;
on this CPU each of its rows gives the logits a one-token pass there gives, bit for bit
(checked below), so its draws are plain decoding's.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

PARAGRAPH = ("The lighthouse stood on a spit of black rock at the mouth of the harbour. "
             "Every evening the keeper climbed the hundred and twelve steps.")
QUOTE = "Repeat this paragraph exactly, word for word:\n\n" + PARAGRAPH
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 42}}


async def ask(client, url: str, prompt: str, sampling: dict, speculation: bool = True) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "speculation": speculation, **sampling}
    response = await client.post(f"{url}/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def scenario(url: str, sampling: dict) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        plain = await ask(client, url, QUOTE, sampling, speculation=False)
        alone = await ask(client, url, QUOTE, sampling)
        fused, _ = await asyncio.gather(
            ask(client, url, QUOTE, sampling),
            ask(client, url, "Repeat: " + PARAGRAPH[:60], {"temperature": 0.7, "seed": 3}))
        again = await ask(client, url, QUOTE, sampling)
    return [plain, alone, fused, again]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mlx_speculation_gives_the_tokens_plain_decoding_gives(mlx_server, mode):
    plain, *drafted = asyncio.run(scenario(mlx_server.base_url, MODES[mode]))
    text = plain["choices"][0]["message"]["content"]
    assert all(answer["choices"][0]["message"]["content"] == text for answer in drafted)
    assert plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    accepted = [a["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
                for a in drafted]
    alone, _, again = accepted  # fused, beside others, a fresh request does not draft
    assert alone > 0 and again > 0
    metrics = mlx_server.metrics()
    assert metrics["butter_speculative_accepted_tokens_total"] >= sum(accepted)


def test_a_verify_row_is_a_one_token_pass_bit_for_bit(loaded):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    network = loaded.network
    ids = loaded.tokenize(PARAGRAPH, add_special=False, parse_special=False)
    cache = make_prompt_cache(network)
    network(mx.array([ids[:-4]]), cache=cache)
    alone = [network(mx.array([[token]]), cache=cache)[0, -1] for token in ids[-4:]]
    for layer in cache:
        layer.trim(4)
    together = network(mx.array([ids[-4:]]), cache=cache)[0]
    mx.eval(alone, together)
    assert all(mx.array_equal(row, together[i]) for i, row in enumerate(alone))
