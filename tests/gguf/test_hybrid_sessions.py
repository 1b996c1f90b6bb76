"""Sessions on a hybrid model (the tiny Qwen3.5: Gated DeltaNet layers beside full
attention), on the GGUF back end: fused steps, recurrent-state snapshots (SPEC 5).

A recurrent state cannot be cut back, so a session keeps snapshots of it at positions
that are multiples of ``SNAPSHOT_EVERY`` and a few tokens before a prompt's end; a later
prompt sharing a prefix resumes from the last one inside it. What a user sees: tool
rounds that resend the whole conversation report the previous prompt as cached (less
the tokens the template renders otherwise), the tokens reported cached are the tokens
not prefilled, and an answer is the same alone, fused with other requests and asked
again.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import ServerProcess
from helpers import alone_fused_again, notes
from support.chunked_read import read_from
from support.conversations import check_tool_rounds_resume_from_snapshots

SNAPSHOT_EVERY = 32  # butter_backend_gguf.recurrent.SNAPSHOT_EVERY


@pytest.fixture(scope="module")
def hybrid(tiny_qwen35_gguf):
    server = ServerProcess("--parallel", "4", "--max-context", "8192",
                           model=str(tiny_qwen35_gguf))
    server.model_id = server.models()[0]["id"]
    yield server
    server.stop()


def test_tool_rounds_reuse_the_previous_prompt_from_a_snapshot(hybrid) -> None:
    # The tail snapshot stands 4 (or 5) tokens before the previous prompt's end.
    usage, before, after = check_tool_rounds_resume_from_snapshots(hybrid, SNAPSHOT_EVERY, 5)
    cached = sum(c for _, c in usage)
    assert after["butter_cached_tokens_total"] - before["butter_cached_tokens_total"] == cached


SHORT = "Describe a lighthouse keeper's morning."
LONG = notes(40, "the harbour") + "\nSummarise these notes."  # past 256 cells: split rows
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 1234}}


async def scenario(server: ServerProcess, prompt: str, sampling: dict) -> tuple[str, str, str]:
    others = [(notes(30, "the quay") + "\nSummarise.", 16, {"temperature": 0.8}),
              ("Explain how bread rises.", 24, {"temperature": 0.0}),
              ("Tell me about the first railway.", 24, {"temperature": 0.8, "seed": 7})]
    async with httpx.AsyncClient(timeout=300) as client:
        return await alone_fused_again(client, server.base_url, server.model_id, prompt, 24,
                                       sampling, others)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_a_hybrid_answer_is_the_same_alone_fused_and_again(hybrid, prompt, mode) -> None:
    before = hybrid.metrics()["butter_model_passes_total"]
    alone, fused, again = asyncio.run(scenario(hybrid, prompt, MODES[mode]))
    assert fused == alone
    assert again == alone
    # Fused: four requests' decode rows share passes (fewer passes than one per row).
    assert hybrid.metrics()["butter_model_passes_total"] - before < 3 * 24 + 16 + 24


def test_a_hybrid_mixture_of_experts_answer_is_the_same_alone_fused_and_again(
        tiny_qwen35_moe_gguf) -> None:
    server = ServerProcess("--parallel", "4", "--max-context", "8192",
                           model=str(tiny_qwen35_moe_gguf))
    server.model_id = server.models()[0]["id"]
    try:
        for sampling in MODES.values():
            alone, fused, again = asyncio.run(scenario(server, SHORT, sampling))
            assert fused == alone and again == alone
    finally:
        server.stop()


@pytest.fixture(scope="module")
def runtime(tiny_qwen35_gguf):
    from butter.backend import KVSpec
    from butter.library import default_plugins

    plugins = default_plugins()
    model = plugins.backends["gguf"].load(plugins.resolve(str(tiny_qwen35_gguf)), threads=2)
    runtime = model.create_runtime(kv=KVSpec(), capacity=4096, n_sessions=3, max_batch=512,
                                   options={"kv_layout": "per-session"})
    yield model, runtime
    runtime.close()
    model.close()


def read(runtime, session: int, tokens: list[int], cuts: list[int] = (), *,
         answer: int = 4) -> list:
    """Feed the rest of ``tokens`` after what ``session`` holds, in chunks ending at ``cuts``
    and multiples of 256 (as the engine cuts them), draw ``answer`` greedy tokens; return
    every draw's log-probabilities."""
    return read_from(runtime, session, tokens, cuts, runtime._lengths[session], answer)


def test_a_prompt_resumed_from_a_snapshot_reads_as_it_did_whole(runtime) -> None:
    """Cut anywhere, resumed from a snapshot, or forked from another session at one: the
    rest of the prompt computes the same log-probabilities as one uncut read, to the bit."""
    model, runtime = runtime
    tokens = model.tokenize(LONG * 2, add_special=False, parse_special=False)[:700]
    runtime.truncate(0, 0)
    whole = read(runtime, 0, tokens)
    for cut in (9, 100, 250, 300, 505):
        runtime.truncate(1, 0)
        assert read(runtime, 1, tokens, [cut]) == whole, cut
    for keep in (650, 600, 300, 40):
        runtime.truncate(1, 0)
        read(runtime, 1, tokens)
        at = runtime.reachable(1, keep)
        assert at % SNAPSHOT_EVERY == 0 and keep - 8 * SNAPSHOT_EVERY < at <= keep
        assert runtime.truncate(1, at)
        assert read(runtime, 1, tokens) == whole, keep
    for length in (640, 256):
        at = runtime.reachable(0, length)
        assert at == length and runtime.fork(0, 2, at)
        assert read(runtime, 2, tokens) == whole, length
    assert runtime.truncate(0, 0) and runtime.reachable(0, 500) == 0
    assert not runtime.truncate(1, 33)  # no snapshot there: nothing dropped


def test_admission_counts_the_snapshots(runtime) -> None:
    _, runtime = runtime
    kv = runtime.kv
    assert kv.snapshot_bytes > 0 and kv.snapshots >= 1
    assert kv.cost(5 * SNAPSHOT_EVERY) - kv.cost(5 * SNAPSHOT_EVERY - 1) \
        == kv.token_bytes + kv.snapshot_bytes
    held = kv.cost(100 * SNAPSHOT_EVERY) - 100 * SNAPSHOT_EVERY * kv.token_bytes
    assert held == kv.snapshots * kv.snapshot_bytes
