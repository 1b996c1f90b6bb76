"""Same request, same answer, whatever else runs (SPEC 5), on the per-session KV layout.

After a burst of mixed traffic, each prompt is asked alone, then with three others
(one of them prefilling a long prompt), then alone again: greedy and seeded answers
must match to the character, for a short prompt and for one long enough (600+ tokens)
that a lone row would take ggml's split-KV attention path.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import ServerProcess
from helpers import alone_fused_again, answer, notes
from support.chunked_read import read_from

SHORT = "Describe a lighthouse keeper's morning."
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 1234}}


LONG = notes(45, "the harbour") + "\nSummarise these notes."


@pytest.fixture(scope="module")
def lanes():
    server = ServerProcess("--parallel", "4", "--max-context", "8192")
    yield server
    server.stop()


async def scenario(url: str, prompt: str, sampling: dict) -> tuple[str, str, str]:
    others = [(notes(70, "the quay") + "\nSummarise.", 24, {"temperature": 0.8}),
              ("Explain how bread rises.", 40, {"temperature": 0.0}),
              ("Tell me about the first railway.", 40, {"temperature": 0.8, "seed": 7})]
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(answer(client, url, "smollm2",
                                      f"Warm-up {n}. " + notes(5 + 9 * n, "fog"), 4 + 6 * n,
                                      {"temperature": 0.8}) for n in range(6)))
        return await alone_fused_again(client, url, "smollm2", prompt, 40, sampling, others)


@pytest.mark.slow  # a burst of mixed traffic per case: 5+ minutes each on a busy machine
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_an_answer_does_not_depend_on_what_runs_beside_it(lanes, prompt, mode) -> None:
    alone, fused, again = asyncio.run(scenario(lanes.base_url, prompt, MODES[mode]))
    assert fused == alone
    assert again == alone


@pytest.fixture(scope="module", params=["raw", "affine8"])
def runtime(request):
    """Both ways of reading: a float cache (row by row, then tiled) and a quantized one
    (row by row throughout, one pass per chunk)."""
    from butter.backend import KVSpec
    from butter.library import default_plugins

    plugins = default_plugins()
    model = plugins.backends["gguf"].load(plugins.resolve("smollm2"), threads=2)
    kv = KVSpec(codec=plugins.kv_codec(request.param))
    runtime = model.create_runtime(kv=kv, capacity=2048, n_sessions=2, max_batch=512,
                                   options={"kv_layout": "per-session"})
    yield model, runtime
    runtime.close()
    model.close()


def read(runtime, session: int, tokens: list[int], cuts: list[int], answer: int = 4) -> list:
    """Feed ``tokens`` in chunks ending at ``cuts`` (then at multiples of 256, as the engine
    cuts them), draw ``answer`` greedy tokens; return every draw's log-probabilities."""
    runtime.truncate(session, 0)
    return read_from(runtime, session, tokens, cuts, 0, answer)


@pytest.mark.parametrize("cut", [9, 100, 250, 256, 300, 500, 505])
def test_a_prompt_reads_the_same_wherever_its_chunks_are_cut(runtime, cut) -> None:
    """A cached prefix ends anywhere: the rest of the prompt must compute the same
    log-probabilities as one uncut read, to the last bit (a short tiled chunk is where
    ggml would sum differently)."""
    model, runtime = runtime
    tokens = model.tokenize(LONG, add_special=False, parse_special=False)[:520]
    assert read(runtime, 1, tokens, [cut]) == read(runtime, 0, tokens, [])


def converse(runtime, session: int, prompt: list[int], answer: list[int], tail: list[int],
             cuts: list[int]) -> list:
    """Read ``prompt``, decode ``answer`` row by row (as an answer is), then read the next
    turn (``prompt + answer + tail``) from there, its tail cut at ``cuts``."""
    from butter.backend import SamplingParams, Work

    read(runtime, session, prompt, [], answer=1)
    sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))
    try:
        for token in answer:
            runtime.step([Work(session, (token,), sampler)])
    finally:
        sampler.close()
    turn = prompt + answer + tail
    return read_from(runtime, session, turn, cuts, len(prompt) + len(answer))


@pytest.mark.parametrize("tail", [3, 20, 39, 120])
def test_a_turn_after_an_answer_reads_the_same_wherever_its_tail_is_cut(runtime, tail):
    """A next turn's tail after a decoded answer goes row by row when it is short (no
    64-row pass) and as any prompt when not: either way, the same to the last bit
    wherever the engine cuts it (alone, fused, or cut short by a step's budget)."""
    model, runtime = runtime
    tokens = model.tokenize(LONG, add_special=False, parse_special=False)
    prompt, answer, rest = tokens[:300], tokens[300:310], tokens[400:400 + tail]
    start = len(prompt) + len(answer)
    whole = converse(runtime, 0, prompt, answer, rest, [])
    for cut in sorted({1, 2, tail // 2, tail - 2} - {0}):
        assert converse(runtime, 1, prompt, answer, rest, [start + cut]) == whole, cut


def ask_under(runtime, session: int, system: list[int], question: list[int],
              cached: list[int] | None = None, cuts: tuple[int, ...] = ()) -> tuple[int, list]:
    """Read ``system + question`` (its final message ``question``) into ``session``,
    first taking what ``session`` holds of it (``cached``: the tokens it holds) as far as
    the runtime keeps it for this prompt; the prefix kept and every draw's logprobs."""
    from butter.backend import PromptTail
    from butter.engine.admission import common_prefix

    tokens = system + question
    tail = PromptTail(len(system), len(tokens))
    keep = 0
    if cached is not None:
        keep = runtime.reachable(session, min(common_prefix(cached, tokens), len(tokens) - 1),
                                 tail)
    assert runtime.truncate(session, keep)
    return keep, read_from(runtime, session, tokens, cuts, keep, tail=tail)


def test_a_new_question_on_a_cached_system_prompt_reads_as_a_cold_read(runtime) -> None:
    """A short final message goes row by row in every read (no 64-row pass with filler),
    so a new question after a system prompt another request read costs only its own rows
    and computes, to the last bit, what a cold read of the same prompt computes: whether
    the prefix came from a question read that way, or from a long question read on the
    prompt path (then the runtime keeps only the system prompt)."""
    from butter.engine.admission import common_prefix

    model, runtime = runtime
    tokens = model.tokenize(LONG, add_special=False, parse_special=False)
    system, header = tokens[:300], tokens[300:303]
    short, other = header + tokens[400:412], header + tokens[420:437]
    long = header + tokens[450:520]  # 73 rows: read on the prompt path
    _, cold = ask_under(runtime, 0, system, short)
    for before in (other, long):
        ask_under(runtime, 1, system, before)
        kept, warm = ask_under(runtime, 1, system, short, system + before)
        assert warm == cold, len(before)
        shared = common_prefix(before, short)
        quantized = runtime.cache_types.quantized  # one path: every prefix is kept
        assert kept == len(system) + (shared if before is other or quantized else 0)
    # A long question after a short one keeps the system prompt only, and reads as cold.
    _, long_cold = ask_under(runtime, 0, system, long)
    kept, long_warm = ask_under(runtime, 1, system, long, system + short)
    assert long_warm == long_cold
    # The short question read in chunks cut anywhere in it reads the same.
    for cut in (302, 305, 310):
        assert ask_under(runtime, 1, system, short, cuts=(cut,))[1] == cold, cut
