"""One conformance suite, run against every registered back end that loads the shipped GGUF."""

import concurrent.futures
import time

import pytest

from butter.backend import ForkKind, KVSpec, SamplingParams, Work
from butter.engine.scheduler import EngineConfig
from butter.errors import ButterError
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
    backend = plugins.backends[request.param]
    model = backend.load(plugins.resolve("smollm2"), threads=2 if backend.takes_threads else None)
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


# ---- through the engine: submit, stream, cancel, prefix reuse, fused seeds, close ------

@pytest.fixture(scope="module", params=gguf_backends())
def engine_model(request):
    from butter.library import Model

    with Model.load("smollm2", backend=request.param) as model:
        model.start_engine(EngineConfig(parallel=2, capacity=2048))
        yield model


QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


def test_submit_stream_and_reuse_a_prefix(engine_model):
    whole = engine_model.generate(QUESTION, max_tokens=8, temperature=0)
    assert "Paris" in whole.text and whole.usage.completion_tokens <= 8
    chunks = list(engine_model.generate_stream(QUESTION, max_tokens=8, temperature=0))
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason and chunks[-1].usage.cached_tokens > 0  # prefix reused


def test_cancel_frees_the_session(engine_model):
    stream = engine_model.generate_stream(QUESTION, max_tokens=64, temperature=0,
                                          ignore_eos=True)
    next(stream)
    stream.close()  # the engine drops the request at its next step
    engine = engine_model.engine
    deadline = time.monotonic() + 60
    while engine.metrics.active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metrics.active_requests == 0 and engine.metrics.sessions_busy == 0
    assert engine_model.generate(QUESTION, max_tokens=4, temperature=0).text


def test_a_seed_means_the_same_in_a_fused_batch(engine_model):
    def ask(seed):
        return engine_model.generate([{"role": "user", "content": "Say a word."}],
                                     max_tokens=6, temperature=1.2, seed=seed).text

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, [7, 7]))
    assert together[0] == together[1]  # each request draws from its own key


def test_close_ends_waiting_requests(engine_model):
    from butter.library import Model

    with Model.load("smollm2", backend=engine_model.backend_name) as model:
        stream = model.generate_stream(QUESTION, max_tokens=64, temperature=0, ignore_eos=True)
        next(stream)
    with pytest.raises(ButterError):
        list(stream)


# ---- sampling fields: top_k, logit_bias, penalties ------------------------------------

def test_top_k_1_is_deterministic_at_any_temperature(engine_model):
    answers = {engine_model.generate(QUESTION, max_tokens=6, temperature=1.5, top_k=1,
                                     seed=seed).text for seed in range(4)}
    assert len(answers) == 1


def test_min_p_1_keeps_only_the_likeliest_token(engine_model):
    greedy_text = engine_model.generate(QUESTION, max_tokens=6, temperature=0).text
    answers = {engine_model.generate(QUESTION, max_tokens=6, temperature=1.5, top_k=0,
                                     min_p=1.0, seed=seed).text for seed in range(3)}
    assert answers == {greedy_text}


def test_a_mask_decides_the_draw_and_logprobs_are_the_models(loaded):
    """``Work.mask`` (a grammar's packed bitmask) limits the draw, in a fused step too;
    ``Sampler.last`` holds the model's own log-probabilities."""
    import numpy as np

    runtime = runtime_of(loaded, capacity=512, n_sessions=2, max_batch=256)
    tokens = loaded.tokenize(PROMPT, add_special=True, parse_special=True)
    free = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0, logprobs=3))
    bound = runtime.new_sampler(SamplingParams(temperature=0.8, top_p=1.0, seed=0))
    forced = loaded.tokenize(" banana", add_special=False, parse_special=False)[-1]
    mask = np.zeros((loaded.info.n_vocab + 31) // 32, dtype=np.int32)
    mask[forced // 32] = np.int32(np.uint32(1 << (forced % 32)).view(np.int32))
    try:
        drawn = runtime.step([Work(0, tokens, free), Work(1, tokens, bound, mask)])
        assert drawn[1] == forced
        last = free.last
        assert last.token == drawn[0] == last.top[0][0] and len(last.top) == 3
        assert last.logprob == last.top[0][1] <= 0.0
        assert [lp for _, lp in last.top] == sorted((lp for _, lp in last.top), reverse=True)
        again = runtime.step([Work(0, (drawn[0],), free), Work(1, (forced,), bound, mask)])
        assert again[1] == forced
    finally:
        free.close()
        bound.close()
        runtime.close()


def test_logit_bias_bans_and_forces_tokens(engine_model):
    loaded = engine_model.loaded
    plain = engine_model.generate(QUESTION, max_tokens=3, temperature=0, ignore_eos=True)
    first = loaded.tokenize(plain.text, add_special=False, parse_special=False)[0]
    banned = engine_model.generate(QUESTION, max_tokens=3, temperature=0, ignore_eos=True,
                                   logit_bias={first: -100})
    assert loaded.tokenize(banned.text, add_special=False, parse_special=False)[0] != first
    forced = loaded.tokenize(" banana", add_special=False, parse_special=False)[-1]
    pushed = engine_model.generate(QUESTION, max_tokens=3, temperature=0.8, seed=1,
                                   ignore_eos=True, logit_bias={forced: 100})
    assert pushed.text == loaded.token_piece(forced).decode() * 3


def test_a_frequency_penalty_makes_greedy_text_repeat_less(engine_model):
    ask = [{"role": "user", "content": "Write the word apple twenty times."}]

    def distinct(**penalty):
        text = engine_model.generate(ask, max_tokens=24, temperature=0, ignore_eos=True,
                                     **penalty).text
        return len(set(engine_model.loaded.tokenize(text, add_special=False,
                                                    parse_special=False)))

    assert distinct(frequency_penalty=2.0) > distinct()
