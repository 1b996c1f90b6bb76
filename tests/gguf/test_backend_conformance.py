"""One conformance suite, run against every registered back end that loads the shipped GGUF."""

import pytest

from butter.backend import ForkKind, KVSpec, SamplingParams, Work
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


def runtime_of(loaded, *, capacity: int, n_sessions: int, max_batch: int):
    return loaded.create_runtime(kv=KVSpec(), capacity=capacity, n_sessions=n_sessions,
                                 max_batch=max_batch, options={})


def greedy_sampler(runtime):
    return runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))


def greedy(runtime, session, tokens, n):
    """Prefill ``tokens`` into ``session`` and draw ``n`` greedy tokens."""
    sampler = greedy_sampler(runtime)
    try:
        (token,) = runtime.step([Work(session, tokens, sampler)])
        generated = [token]
        while len(generated) < n:
            (token,) = runtime.step([Work(session, (token,), sampler)])
            generated.append(token)
        return generated
    finally:
        sampler.close()


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
    runtime = runtime_of(loaded, capacity=512, n_sessions=2, max_batch=128)
    try:
        tokens = loaded.tokenize(PROMPT, add_special=False, parse_special=True)
        first = greedy(runtime, 0, tokens, 8)
        assert "Paris" in b"".join(loaded.token_piece(t) for t in first).decode()
        # A second session gives the same answer; dropping and redoing session 0 too.
        assert greedy(runtime, 1, tokens, 8) == first
        assert runtime.truncate(0, 0)
        assert greedy(runtime, 0, tokens, 8) == first
        # Cut back to the prompt less one token, then the answer follows again.
        assert runtime.truncate(0, len(tokens) - 1)
        assert greedy(runtime, 0, tokens[-1:], 3) == first[:3]
        # Fused: both sessions' next tokens in one step give one token each.
        sampler = greedy_sampler(runtime)
        drawn = runtime.step([Work(0, (first[2],), sampler), Work(1, (first[7],), sampler)])
        assert len(drawn) == 2 and all(isinstance(t, int) for t in drawn)
        assert runtime.step([Work(0, (first[3],))]) == [None]  # fed, nothing drawn
        sampler.close()
    finally:
        runtime.close()


def test_a_forked_prefix_answers_like_its_source(loaded):
    runtime = runtime_of(loaded, capacity=512, n_sessions=3, max_batch=128)
    try:
        tokens = loaded.tokenize(PROMPT, add_special=False, parse_special=True)
        first = greedy(runtime, 0, tokens, 8)
        # Session 1 forks session 0's prompt less its last token, then prefills that token
        # itself: the same greedy answer follows.
        assert runtime.fork(0, 1, len(tokens) - 1)
        assert greedy(runtime, 1, tokens[-1:], 2) == first[:2]
        # Dropping the source leaves the forked prefix to session 1: its answer goes on.
        assert runtime.truncate(0, 0)
        assert greedy(runtime, 1, (first[1],), 2) == first[2:4]
        # A fork replaces whatever the target held.
        greedy(runtime, 2, tokens[:5], 1)
        assert runtime.fork(1, 2, len(tokens) - 1)
        assert greedy(runtime, 2, tokens[-1:], 2) == first[:2]
        assert runtime.kv.fork is not ForkKind.NONE
    finally:
        runtime.close()


def test_kv_facts_count_bytes(loaded):
    runtime = runtime_of(loaded, capacity=512, n_sessions=1, max_batch=64)
    try:
        facts = runtime.kv
        assert facts.token_bytes > 0 and facts.max_positions >= 512
        assert facts.budget_bytes >= 512 * facts.token_bytes
        assert facts.cost(100) >= 100 * facts.token_bytes
    finally:
        runtime.close()


def test_seeded_sampling_repeats_and_seeds_matter(loaded):
    runtime = runtime_of(loaded, capacity=256, n_sessions=1, max_batch=64)
    try:
        tokens = loaded.tokenize("<|im_start|>user\nSay a word.<|im_end|>\n<|im_start|>"
                                 "assistant\n", add_special=False, parse_special=True)

        def draw(seed):
            sampler = runtime.new_sampler(SamplingParams(temperature=1.5, top_p=1.0, seed=seed))
            try:
                runtime.truncate(0, 0)
                return runtime.step([Work(0, tokens, sampler)])[0]
            finally:
                sampler.close()

        assert draw(42) == draw(42)
        assert len({draw(seed) for seed in range(20)}) > 1
    finally:
        runtime.close()
