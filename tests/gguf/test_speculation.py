"""Prompt-lookup speculation on the real SmolLM2 (GGUF): the same tokens as without it.

Asked to repeat a paragraph, the model copies it, so most of its answer is drafted from
the prompt and verified in one pass. Greedy and seeded answers must be the same to the
character with `speculation: false` and with drafting, asked alone, beside three other
requests and again (SPEC 5); usage and /metrics count what was drafted and accepted.

On a quantized cache (`--kv-cache affine8`, q8_0) ggml's flash attention has one path for
every row, so drafting goes on past a stream's first 256 cells: the same check after a
long preamble, the others beside it long too.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import ServerProcess

PARAGRAPH = ("The lighthouse stood on a spit of black rock at the mouth of the harbour. "
             "Every evening the keeper climbed the hundred and twelve steps, trimmed the "
             "wick, wound the clockwork that turned the lens, and wrote the weather in a "
             "leather book. Ships that passed in the night never saw him, only the long "
             "white beam sweeping the water.")
QUOTE = "Repeat this paragraph exactly, word for word:\n\n" + PARAGRAPH
MODES = {"greedy": {"temperature": 0.0},
         "seeded": {"temperature": 0.8, "seed": 42, "top_k": 40, "top_p": 0.95}}
MAX_TOKENS = 90
PREAMBLE = " ".join(f"Note {n}: the tide table for day {n} was filed by the harbour "
                    f"office." for n in range(1, 31))
LONG_QUOTE = f"Background (ignore it): {PREAMBLE}\n\n{QUOTE}"


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--parallel", "4", "--max-context", "4096")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def quantized():
    process = ServerProcess("--parallel", "4", "--max-context", "8192", "--kv-cache", "affine8")
    yield process
    process.stop()


async def ask(client: httpx.AsyncClient, url: str, prompt: str, sampling: dict,
              speculation: bool = True) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "speculation": speculation, **sampling}
    response = await client.post(f"{url}/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def scenario(url: str, sampling: dict, quote: str = QUOTE,
                   before: str = "") -> dict[str, dict]:
    async with httpx.AsyncClient(timeout=300) as client:
        plain = await ask(client, url, quote, sampling, speculation=False)
        alone = await ask(client, url, quote, sampling)
        others = [ask(client, url, before + "Explain how bread rises.", {"temperature": 0.0}),
                  ask(client, url, before + "Repeat: " + PARAGRAPH[:120],
                      {"temperature": 0.8, "seed": 5}),
                  ask(client, url, before + "Tell me about the first railway.",
                      {"temperature": 0.7})]
        fused, *_ = await asyncio.gather(ask(client, url, quote, sampling), *others)
        again = await ask(client, url, quote, sampling)
    return {"plain": plain, "alone": alone, "fused": fused, "again": again}


def text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_speculation_gives_the_tokens_plain_decoding_gives(server, mode) -> None:
    before = server.wait_idle()
    answers = asyncio.run(scenario(server.base_url, MODES[mode]))
    plain = text(answers["plain"])
    assert PARAGRAPH[:40] in plain  # the model does copy: the case drafting is for
    for name in ("alone", "fused", "again"):
        assert text(answers[name]) == plain, name
    details = answers["plain"]["usage"]["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    accepted = answers["alone"]["usage"]["completion_tokens_details"]
    assert accepted["accepted_prediction_tokens"] > MAX_TOKENS // 3
    assert answers["again"]["usage"]["completion_tokens_details"] == accepted
    after = server.wait_idle()
    drafted = after["butter_speculative_drafted_tokens_total"] \
        - before["butter_speculative_drafted_tokens_total"]
    kept = after["butter_speculative_accepted_tokens_total"] \
        - before["butter_speculative_accepted_tokens_total"]
    # Beside three others a request drafts fewer tokens (they share each pass's cost).
    counted = sum(answers[name]["usage"]["completion_tokens_details"]
                  ["accepted_prediction_tokens"] for name in ("alone", "fused", "again"))
    assert drafted >= kept >= counted


# After the preamble, SmolLM2 at 0.8 paraphrases rather than copies: seeded runs cooler.
LONG_MODES = {"greedy": MODES["greedy"], "seeded": {**MODES["seeded"], "temperature": 0.4}}


@pytest.mark.parametrize("mode", sorted(LONG_MODES))
def test_a_quantized_cache_drafts_past_256_cells_with_the_same_tokens(quantized, mode) -> None:
    answers = asyncio.run(scenario(quantized.base_url, LONG_MODES[mode], LONG_QUOTE,
                                   before=f"Background: {PREAMBLE}\n\n"))
    plain = text(answers["plain"])
    assert answers["plain"]["usage"]["prompt_tokens"] > 300  # the answer starts past 256
    assert PARAGRAPH[:40] in plain
    for name in ("alone", "fused", "again"):
        assert text(answers[name]) == plain, name
    accepted = answers["alone"]["usage"]["completion_tokens_details"]
    assert accepted["accepted_prediction_tokens"] > MAX_TOKENS // 3
