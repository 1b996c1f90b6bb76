"""Qwen3.5's multi-token-prediction head on the MLX back end (``--speculation mtp``),
on the tiny random-weight Qwen3.5 whose folder carries ``mtp.*`` weights.

The head drafts one token per verify; each answer is token for token what plain
decoding gives. Random weights draft badly, so a second head is built to copy its input
token: its drafts are accepted wherever the model repeats one, which this tiny model
does, and the accepted path (a two-token pass that stays) is checked as well.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow  # MLX on a CPU

PROMPT = [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat."}]
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 7}}


@pytest.fixture(scope="module")
def copying_folder(tmp_path_factory, tiny_qwen35_sdist):
    """The tiny Qwen3.5 (same main weights) with a head that guesses a repeat."""
    from support.tiny_qwen35 import build_hf_folder

    return build_hf_folder(tmp_path_factory.mktemp("tiny-qwen35-mtp-copy") / "MTP-copy",
                           mtp=True, mtp_copies=True)


def answer(model, speculation: str, sampling: dict, *, max_tokens: int = 60):
    model.start_engine(model.engine_config(capacity=4096, speculation=speculation))
    result = model.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return (result.reasoning, result.text), result.usage


def test_the_head_loads_where_the_folder_has_it(tiny_qwen35_mtp_folder, tiny_qwen35_folder):
    from butter.library import Model

    with Model.load(str(tiny_qwen35_mtp_folder), backend="mlx") as model:
        assert model.info.draft_head
        head = model.loaded.mtp
        assert len(head.layers) == 1 and not head.layers[0].is_linear  # full attention
    with Model.load(str(tiny_qwen35_folder), backend="mlx") as model:
        assert not model.info.draft_head
        with pytest.raises(Exception, match="multi-token-prediction head"):
            model.start_engine(model.engine_config(capacity=4096, speculation="mtp"))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mtp_answers_are_plain_decoding_s(tiny_qwen35_mtp_folder, tiny_qwen35_folder,
                                         copying_folder, mode):
    from butter.library import Model

    sampling = MODES[mode]
    with Model.load(str(tiny_qwen35_folder), backend="mlx") as model:
        plain, _ = answer(model, "none", sampling)
    for folder in (tiny_qwen35_mtp_folder, copying_folder):
        with Model.load(str(folder), backend="mlx") as model:
            off, usage = answer(model, "none", sampling)
            assert off == plain and usage.rejected_prediction_tokens == 0
            drafted, usage = answer(model, "mtp", sampling)
            assert drafted == plain
            assert usage.accepted_prediction_tokens + usage.rejected_prediction_tokens > 0
            metrics = model.engine.metrics
            assert metrics.draft_tokens == (usage.accepted_prediction_tokens
                                            + usage.rejected_prediction_tokens)


def _decode(runtime, prompt, sampler, count: int, *, drafting: bool):
    """``count`` tokens of one session: plainly, or each step verifying the head's draft."""
    from butter.backend import Work

    token = runtime.step([Work(0, prompt, sampler)])[0]
    tokens, accepted = [token], 0
    while len(tokens) < count:
        draft = runtime.propose(0, tokens[-1]) if drafting else ()
        result = runtime.step([Work(0, (tokens[-1], *draft), sampler, None, draft)])[0]
        draws = result if draft else (result,)
        accepted += len(draws) - 1
        tokens.extend(draws)
    return tokens[:count], accepted


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_draft_every_step_keeps_the_tokens_and_some_are_accepted(copying_folder, mode):
    """No pause after failed verifies here: every step verifies the copying head's draft,
    through both paths (kept two-token passes, and rejected ones fed again)."""
    from butter.backend import KVSpec, SamplingParams
    from butter.library import Model

    params = SamplingParams(temperature=MODES[mode]["temperature"], top_p=1.0,
                            seed=MODES[mode].get("seed", 0))
    with Model.load(str(copying_folder), backend="mlx") as model:
        prompt = model.encode(model.template.render(PROMPT, add_generation_prompt=True))
        results = []
        for drafting in (False, True):
            runtime = model.loaded.create_runtime(kv=KVSpec(), capacity=4096, n_sessions=2,
                                                  max_batch=512, options={})
            sampler = runtime.new_sampler(params)
            results.append(_decode(runtime, prompt, sampler, 80, drafting=drafting))
            runtime.close()
    (plain, _), (drafted, accepted) = results
    assert drafted == plain
    assert accepted >= 5  # 13 of 80 greedy, 8 seeded, when this was written


@pytest.fixture(scope="module")
def mtp_server(tiny_qwen35_mtp_folder):
    from conftest import ServerProcess

    server = ServerProcess("--backend", "mlx", "--speculation", "mtp", "--parallel", "2",
                           model=str(tiny_qwen35_mtp_folder), timeout=180)
    yield server
    server.stop()


async def _scenario(url: str, sampling: dict) -> list[dict]:
    """Plain, then drafted: alone, beside another request, and asked again (SPEC 5)."""
    async with httpx.AsyncClient(timeout=300) as client:
        model = (await client.get(f"{url}/models")).json()["data"][0]["id"]

        async def ask(messages, speculation=True, **extra):
            body = {"model": model, "messages": messages, "max_tokens": 40,
                    "ignore_eos": True, "speculation": speculation, **sampling, **extra}
            response = await client.post(f"{url}/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        plain = await ask(PROMPT, speculation=False)
        alone = await ask(PROMPT)
        fused, _ = await asyncio.gather(
            ask(PROMPT), ask([{"role": "user", "content": "Count to ten."}], seed=3))
        again = await ask(PROMPT)
    return [plain, alone, fused, again]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_served_mtp_answers_alone_fused_and_again_are_plain_decoding_s(mtp_server, mode):
    before = mtp_server.metrics().get("butter_speculative_drafted_tokens_total", 0)
    plain, *drafted = asyncio.run(_scenario(mtp_server.base_url, MODES[mode]))
    message = plain["choices"][0]["message"]
    assert all(answer["choices"][0]["message"] == message for answer in drafted)
    assert plain["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 0
    counts = [answer["usage"]["completion_tokens_details"] for answer in drafted]
    mine = sum(c["accepted_prediction_tokens"] + c["rejected_prediction_tokens"]
               for c in counts)
    assert all(c["accepted_prediction_tokens"] + c["rejected_prediction_tokens"] > 0
               for c in counts)
    # The fused neighbour drafts too: the counter moved at least by these answers' drafts.
    assert mtp_server.metrics()["butter_speculative_drafted_tokens_total"] - before >= mine


def test_mtp_without_a_head_is_a_usage_error(tiny_qwen35_folder):
    result = subprocess.run([sys.executable, "-m", "butter", "serve", "--backend", "mlx",
                             "--model", str(tiny_qwen35_folder), "--speculation", "mtp"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--speculation" in result.stderr and "mtp_num_hidden_layers" in result.stderr


def test_a_two_token_hybrid_pass_is_two_one_token_passes_bit_for_bit(tiny_qwen35_mtp_folder):
    """What keeps a kept verify exact on Qwen3.5: its rows' logits, hidden states and the
    recurrent state it leaves are those of one-token passes, bit for bit, on this CPU."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from butter.library import Model
    from butter_backend_mlx.snapshots import capture

    with Model.load(str(tiny_qwen35_mtp_folder), backend="mlx") as model:
        network = model.loaded.network
        ids = model.encode("The lighthouse stood on a spit of black rock at the harbour.")
        states, rows = [], []
        for split in (False, True):
            cache = make_prompt_cache(network)
            network(mx.array([ids[:-2]]), cache=cache)
            if split:
                row = [network.model(mx.array([[token]]), cache)[0, -1] for token in ids[-2:]]
            else:
                row = list(network.model(mx.array([ids[-2:]]), cache)[0])
            state = [a for layer in capture(cache) if layer for a in layer]
            mx.eval(row, state)
            rows.append(row)
            states.append(state)
    assert all(mx.array_equal(a, b) for a, b in zip(*rows))
    assert all(mx.array_equal(a, b) for a, b in zip(*states))
