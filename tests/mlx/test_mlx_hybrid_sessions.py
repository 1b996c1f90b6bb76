"""Sessions on the tiny Qwen3.5 folder (Gated DeltaNet beside full attention) on the MLX
back end: fused steps and recurrent-state snapshots (SPEC 5), as a user sees them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import ServerProcess
from support.conversations import check_tool_rounds_resume_from_snapshots

SNAPSHOT_EVERY = 32  # butter_backend_mlx.snapshots.SNAPSHOT_EVERY


@pytest.fixture(scope="module")
def hybrid(tiny_qwen35_folder):
    server = ServerProcess("--backend", "mlx", "--parallel", "4", "--max-context", "4096",
                           model=str(tiny_qwen35_folder), timeout=180)
    server.model_id = server.models()[0]["id"]
    yield server
    server.stop()


def test_tool_rounds_reuse_the_previous_prompt_from_a_snapshot(hybrid) -> None:
    # The tail snapshot stands 4 tokens before the previous prompt's end.
    check_tool_rounds_resume_from_snapshots(hybrid, SNAPSHOT_EVERY, 4)


async def ask(client: httpx.AsyncClient, url: str, model: str, prompt: str,
              sampling: dict) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "ignore_eos": True, **sampling}
    response = await client.post(f"{url}/chat/completions", json=body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    return (message.get("reasoning_content") or "") + "|" + (message.get("content") or "")


def test_a_seed_means_the_same_alone_and_fused(hybrid) -> None:
    url, model = hybrid.base_url, hybrid.model_id
    seeded = {"temperature": 0.9, "seed": 4321}
    prompt = "Describe a lighthouse keeper's morning."

    async def scenario() -> tuple[str, str]:
        async with httpx.AsyncClient(timeout=300) as client:
            alone = await ask(client, url, model, prompt, seeded)
            fused, *_ = await asyncio.gather(
                ask(client, url, model, prompt, seeded),
                ask(client, url, model, "Explain how bread rises.", {"temperature": 0.9}),
                ask(client, url, model, "Tell me about trains.", {"temperature": 0.0}))
        return alone, fused

    passes = hybrid.metrics()["butter_model_passes_total"]
    alone, fused = asyncio.run(scenario())
    assert fused == alone
    # The three requests' decode rows shared passes.
    assert hybrid.metrics()["butter_model_passes_total"] - passes < 12 + 3 * 12


def test_a_displaced_hybrid_prompt_loads_back_from_its_snapshots(start_server,
                                                                 tiny_qwen35_folder) -> None:
    """One session active, two spare: three other prompts displace the first, whose
    caches and recurrent-state snapshots go to the prompt cache; the first asked again
    loads them back from its tail snapshot, a new question on its system prompt from a
    multiple of 32, and both answer as a fresh read does (a server without the cache)."""
    import openai
    from helpers import notes

    cached_side = start_server("--backend", "mlx", "--parallel", "1",
                               model=str(tiny_qwen35_folder))
    fresh_side = start_server("--backend", "mlx", "--parallel", "1", "--cache-ram", "0",
                              model=str(tiny_qwen35_folder))
    model = cached_side.models()[0]["id"]
    assert cached_side.models()[0]["butter"]["prompt_cache_mib"] == 8192

    def ask(server, system: str, question: str):
        client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0,
                               timeout=180)
        return client.chat.completions.create(
            model=model, max_tokens=12, temperature=0.9, seed=11,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}])

    def cached(completion) -> int:
        return completion.usage.prompt_tokens_details.cached_tokens

    def displace(*topics: str) -> None:
        for topic in topics:
            ask(cached_side, f"You answer in one word about {topic}. " + notes(12, topic),
                "Name one.")

    guide = "You are a guide to glaciers. " + notes(12, "ice")
    first = ask(cached_side, guide, "Name one glacier.")
    displace("deserts", "hills", "lakes")
    again = ask(cached_side, guide, "Name one glacier.")
    assert again.usage.prompt_tokens - 5 <= cached(again) <= again.usage.prompt_tokens - 4
    assert again.choices[0].message.content == first.choices[0].message.content
    displace("rivers", "forests", "islands")
    other = ask(cached_side, guide, "How old is the ice?")
    assert cached(other) >= 32 and cached(other) % 32 == 0
    assert other.choices[0].message.content \
        == ask(fresh_side, guide, "How old is the ice?").choices[0].message.content
    assert cached_side.metrics()["butter_prompt_cache_hits_total"] == 2
