"""One conformance suite, run against every registered back end that loads the shipped GGUF."""

import pytest

from butter.backend import BatchEntry, SamplingParams
from butter.library import default_plugins

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n<|im_start|>user\nName the capital city of France.<|im_end|>\n"
          "<|im_start|>assistant\n")


def gguf_backends():
    plugins = default_plugins()
    resolved = plugins.resolve("smollm2")
    return [name for name, backend in sorted(plugins.backends.items())
            if backend.can_load(resolved)]


@pytest.fixture(scope="module", params=gguf_backends())
def loaded(request):
    plugins = default_plugins()
    model = plugins.backends[request.param].load(plugins.resolve("smollm2"), threads=2)
    yield model
    model.close()


def greedy(runtime, model, seq_id, tokens, n):
    out = runtime.decode([BatchEntry(seq_id, tokens, 0, True)])
    sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))
    generated, position = [], len(tokens)
    for _ in range(n):
        token = runtime.sample(sampler, out[0])
        generated.append(token)
        out = runtime.decode([BatchEntry(seq_id, (token,), position, True)])
        position += 1
    sampler.close()
    return generated


def test_model_facts(loaded):
    info = loaded.info
    assert info.n_ctx_train == 8192 and info.chat_template and info.eos_token == "<|im_end|>"
    assert info.can_rewind and info.fusable


def test_tokenizer_round_trip_and_special_tokens(loaded):
    tokens = loaded.tokenize(PROMPT, add_special=False, parse_special=True)
    assert tokens[0] == 1 and 2 in tokens  # <|im_start|>, <|im_end|> as single tokens
    text = "Hello, wörld 😀"
    pieces = b"".join(loaded.token_piece(t) for t in loaded.tokenize(text, add_special=False,
                                                                   parse_special=False))
    assert pieces.decode() == text
    assert loaded.is_end_of_generation(2) and not loaded.is_end_of_generation(tokens[1])


def test_sessions_are_independent_and_rewindable(loaded):
    runtime = loaded.create_runtime(capacity=512, n_sessions=2, max_batch=128)
    try:
        tokens = loaded.tokenize(PROMPT, add_special=False, parse_special=True)
        first = greedy(runtime, loaded, 0, tokens, 8)
        assert "Paris" in b"".join(loaded.token_piece(t) for t in first).decode()
        # A second session gives the same answer; forgetting and redoing session 0 too.
        assert greedy(runtime, loaded, 1, tokens, 8) == first
        assert runtime.forget(0, 0)
        assert greedy(runtime, loaded, 0, tokens, 8) == first
        # Fused: both sessions' next tokens in one pass give one output each.
        outputs = runtime.decode([BatchEntry(0, (first[0],), len(tokens) + 8, True),
                                  BatchEntry(1, (first[0],), len(tokens) + 8, True)])
        assert len(outputs) == 2
    finally:
        runtime.close()


def test_a_shared_prefix_answers_like_its_source(loaded):
    runtime = loaded.create_runtime(capacity=512, n_sessions=2, max_batch=128)
    try:
        tokens = loaded.tokenize(PROMPT, add_special=False, parse_special=True)
        first = greedy(runtime, loaded, 0, tokens, 8)
        # Session 1 gets session 0's cells for all but the last prompt token, then
        # prefills that one token itself: the same greedy answer follows.
        assert runtime.share(0, 1, len(tokens) - 1)
        out = runtime.decode([BatchEntry(1, tokens[-1:], len(tokens) - 1, True)])
        sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))
        assert runtime.sample(sampler, out[0]) == first[0]
        # Dropping the source leaves the shared cells to session 1: its answer goes on.
        assert runtime.forget(0, 0)
        out = runtime.decode([BatchEntry(1, (first[0],), len(tokens), True)])
        assert runtime.sample(sampler, out[0]) == first[1]
        sampler.close()
    finally:
        runtime.close()


def test_seeded_sampling_repeats_and_seeds_matter(loaded):
    runtime = loaded.create_runtime(capacity=256, n_sessions=1, max_batch=64)
    try:
        tokens = loaded.tokenize("<|im_start|>user\nSay a word.<|im_end|>\n<|im_start|>"
                                 "assistant\n", add_special=False, parse_special=True)
        out = runtime.decode([BatchEntry(0, tokens, 0, True)])

        def draw(seed):
            sampler = runtime.new_sampler(SamplingParams(temperature=1.5, top_p=1.0, seed=seed))
            try:
                return runtime.sample(sampler, out[0])
            finally:
                sampler.close()

        assert draw(42) == draw(42)
        assert len({draw(seed) for seed in range(20)}) > 1
    finally:
        runtime.close()
