"""Sessions on the tiny Qwen3.5 folder (Gated DeltaNet beside full attention) on the MLX
back end: fused steps and recurrent-state snapshots (SPEC 5), as a user sees them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import ServerProcess
from support.conversations import tool_rounds

SNAPSHOT_EVERY = 32  # butter_backend_mlx.snapshots.SNAPSHOT_EVERY


@pytest.fixture(scope="module")
def hybrid(tiny_qwen35_folder):
    server = ServerProcess("--backend", "mlx", "--parallel", "4", "--max-context", "4096",
                           model=str(tiny_qwen35_folder), timeout=180)
    server.model_id = server.models()[0]["id"]
    yield server
    server.stop()


def test_tool_rounds_reuse_the_previous_prompt_from_a_snapshot(hybrid) -> None:
    before = hybrid.wait_idle()
    usage = tool_rounds(hybrid.base_url, hybrid.model_id)
    after = hybrid.wait_idle()
    assert usage[0][1] == 0
    for (previous, _), (prompt, cached) in zip(usage, usage[1:]):
        assert prompt > previous
        # All but the generation prompt's last token, which the template renders otherwise
        # in the history: resumed from the tail snapshot 4 tokens before its end.
        assert cached >= (previous - 1) // SNAPSHOT_EVERY * SNAPSHOT_EVERY > 0, usage
        assert previous - 4 <= cached < previous, usage
    prompts, cached = sum(p for p, _ in usage), sum(c for _, c in usage)
    assert after["butter_prefill_tokens_total"] - before["butter_prefill_tokens_total"] \
        == prompts - cached


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
