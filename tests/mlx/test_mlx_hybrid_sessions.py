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
