"""A greedy draw is read straight off the logits (``GGUFSampler.argmax``): on every row of
a real SmolLM2 pass it must be the token llama.cpp's own greedy sampler picks, with a
grammar mask, with log-probabilities, and where two logits tie (the first wins)."""

from __future__ import annotations

import llama_cpp as ll
import numpy as np
import pytest

from butter.backend import SamplingParams

ROWS = 48
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, seed=0)


@pytest.fixture(scope="module")
def rows():
    """One pass of a real prompt with logits on every row: (context, vocabulary size)."""
    from butter.library import default_plugins

    plugins = default_plugins()
    model = plugins.backends["gguf"].load(plugins.resolve("smollm2"), threads=2)
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
    ctx = ll.llama_init_from_model(model.handle, params)
    tokens = model.tokenize("The keeper climbed the hundred and twelve steps, trimmed the "
                            "wick and wound the clockwork that turned the lens. " * 3,
                            add_special=True, parse_special=False)[:ROWS]
    batch = ll.llama_batch_init(ROWS, 0, 1)
    batch.n_tokens = len(tokens)
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
        batch.seq_id[i][0] = 0
    assert ll.llama_decode(ctx, batch) == 0
    yield ctx, model.info.n_vocab
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    model.close()


@pytest.fixture
def reference():
    """llama.cpp's greedy sampler alone, as the chain would draw."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
    yield lambda ctx, row: int(ll.llama_sampler_sample(chain, ctx, row))
    ll.llama_sampler_free(chain)


def sampler(params: SamplingParams, n_vocab: int):
    from butter_backend_gguf.batch import GGUFSampler

    return GGUFSampler(params, n_vocab)


def row_logits(ctx, row: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row), shape=(n_vocab,))


def packed(allowed: np.ndarray) -> np.ndarray:
    """``allowed`` booleans as ``Work.mask``'s packed little-endian int32 bits."""
    bits = np.packbits(allowed, bitorder="little")
    return np.pad(bits, (0, -len(bits) % 4)).view(np.int32)


def test_a_greedy_draw_is_the_token_llama_cpp_picks_on_every_row(rows, reference) -> None:
    ctx, n_vocab = rows
    greedy = sampler(GREEDY, n_vocab)
    assert greedy.argmax
    draws = [greedy.sample(ctx, row, None) for row in range(ROWS)]
    assert draws == [reference(ctx, row) for row in range(ROWS)]
    assert len(set(draws)) > 10  # real, varied rows


def test_a_masked_and_a_logprobs_greedy_draw_match_llama_cpp(rows, reference) -> None:
    ctx, n_vocab = rows
    rng = np.random.default_rng(7)
    with_logprobs = sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0, logprobs=2),
                            n_vocab)
    masked = sampler(GREEDY, n_vocab)
    for row in range(0, ROWS, 3):
        top = reference(ctx, row)
        assert with_logprobs.sample(ctx, row, None) == top
        assert with_logprobs.last.token == top
        allowed = rng.random(n_vocab) < 0.5
        allowed[top] = False
        draw = masked.sample(ctx, row, packed(allowed))  # writes the mask into the row
        assert draw != top and allowed[draw]
        assert draw == reference(ctx, row)


def test_tied_logits_draw_the_first_and_a_biased_chain_stays_a_chain(rows, reference) -> None:
    ctx, n_vocab = rows
    logits = row_logits(ctx, ROWS - 1, n_vocab)
    logits[[7, 3, 900]] = logits.max() + 1.0
    assert sampler(GREEDY, n_vocab).sample(ctx, ROWS - 1, None) == 3 \
        == reference(ctx, ROWS - 1)
    biased = sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0,
                                    logit_bias=((900, 100.0),)), n_vocab)
    assert not biased.argmax
    assert biased.sample(ctx, ROWS - 1, None) == 900
