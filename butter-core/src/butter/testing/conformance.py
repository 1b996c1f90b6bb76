"""One conformance suite for every back end: what the engine relies on a runtime to do.

Subclass :class:`BackendConformance` in a test module (a class named ``Test...``) and
give it three fixtures (class-scoped ones are class methods, as pytest 9 asks):

- ``loaded``: a :class:`~butter.backend.LoadedModel` of the checkpoint under test;
- ``open_model``: a callable that returns a new :class:`butter.library.Model` of it, not
  yet started (``lambda: Model.load(path, backend="mine")``); the suite starts and
  closes the ones it opens;
- ``model_facts``: the :class:`ModelFacts` the suite checks the checkpoint against.

The runtime tests drive ``create_runtime`` / ``step`` / ``truncate`` / ``fork`` directly;
the engine tests go through ``Model.generate`` (submit, stream, cancel, prefix reuse,
seeds in a fused batch, sampling fields). Prompts are the checkpoint's own chat template
applied to plain English questions, so nothing here names a model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np
import pytest

from butter.backend import ForkKind, KVSpec, LoadedModel, Runtime, SamplingParams, Work
from butter.chat.template import ChatTemplate
from butter.engine.scheduler import EngineConfig
from butter.errors import ButterError

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]
OPEN_QUESTION = [{"role": "user", "content": "Say a word."}]
REPEAT_QUESTION = [{"role": "user", "content": "Write the word apple twenty times."}]
PLAIN_TEXT = "Hello, wörld 😀"  # plain text: its pieces decode back to it
FORCED_TEXT = " banana"  # its last token is the one a mask or a bias forces


@attrs.frozen(kw_only=True)
class ModelFacts:
    """What the suite expects of the checkpoint under test."""

    n_ctx_train: int  # ``ModelInfo.n_ctx_train``
    eos_token: str  # ``ModelInfo.eos_token``: its text, a single token ending generation
    # Control-token texts and the single ids they tokenize to (special tokens parsed).
    control_tokens: Mapping[str, int] = attrs.field(factory=dict)
    answer: str | None = None  # a word the greedy answer to ``QUESTION`` holds
    can_rewind: bool = True  # ``ModelInfo.can_rewind``: truncate and fork work
    fusable: bool = True  # ``ModelInfo.fusable``
    has_chat_template: bool = True


def prompt_of(loaded: LoadedModel, messages: Sequence[Mapping[str, str]]) -> str:
    """``messages`` in the checkpoint's chat template, ready for its answer."""
    info = loaded.info
    template = ChatTemplate(info.chat_template, bos_token=info.bos_token,
                            eos_token=info.eos_token)
    return template.render(messages, add_generation_prompt=True)


@contextlib.contextmanager
def runtime_of(loaded: LoadedModel, *, capacity: int, n_sessions: int,
               max_batch: int) -> Iterator[Runtime]:
    runtime = loaded.create_runtime(kv=KVSpec(), capacity=capacity, n_sessions=n_sessions,
                                    max_batch=max_batch, options={})
    try:
        yield runtime
    finally:
        runtime.close()


def rewinding_runtime(loaded: LoadedModel, model_facts: ModelFacts, *,
                      n_sessions: int) -> contextlib.AbstractContextManager[Runtime]:
    """A runtime for a test that truncates or forks: skipped where the checkpoint cannot."""
    if not model_facts.can_rewind:
        pytest.skip("the checkpoint cannot rewind")
    return runtime_of(loaded, capacity=512, n_sessions=n_sessions, max_batch=128)


def greedy_sampler(runtime: Runtime):
    return runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))


def greedy(runtime: Runtime, session: int, tokens: Sequence[int], n: int) -> list[int]:
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


def text_of(loaded: LoadedModel, tokens: Sequence[int]) -> str:
    return b"".join(loaded.token_piece(t) for t in tokens).decode(errors="replace")


def plain_tokens(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenize(text, add_special=False, parse_special=False)


class BackendConformance:
    """The suite; see the module docstring for the fixtures a subclass gives."""

    @pytest.fixture(scope="class")
    @classmethod
    def prompt_tokens(cls, loaded) -> list[int]:
        return loaded.tokenize(prompt_of(loaded, QUESTION), add_special=False,
                               parse_special=True)

    @pytest.fixture(scope="class")
    @classmethod
    def engine_model(cls, open_model):
        """A model with its engine started: two sessions, 2,048 tokens of KV."""
        with open_model() as model:
            model.start_engine(EngineConfig(parallel=2, capacity=2048))
            yield model

    # ---- the loaded model ------------------------------------------------------------

    def test_model_facts(self, loaded, model_facts):
        info = loaded.info
        assert info.n_ctx_train == model_facts.n_ctx_train
        assert info.eos_token == model_facts.eos_token
        assert bool(info.chat_template) == model_facts.has_chat_template
        assert info.can_rewind == model_facts.can_rewind
        assert info.fusable == model_facts.fusable

    def test_tokenizer_round_trip_and_special_tokens(self, loaded, model_facts, prompt_tokens):
        prompt = prompt_of(loaded, QUESTION)
        for text, token in model_facts.control_tokens.items():
            # A control token's text is one token when special tokens are parsed...
            assert loaded.tokenize(text, add_special=False, parse_special=True) == [token]
            if text in prompt:  # ...in a rendered prompt too
                assert token in prompt_tokens
            if prompt.startswith(text):
                assert prompt_tokens[0] == token
        pieces = b"".join(loaded.token_piece(t) for t in plain_tokens(loaded, PLAIN_TEXT))
        assert pieces.decode() == PLAIN_TEXT
        (eos,) = loaded.tokenize(model_facts.eos_token, add_special=False, parse_special=True)
        assert loaded.is_end_of_generation(eos)
        assert not any(loaded.is_end_of_generation(t) for t in plain_tokens(loaded, "Hello"))

    # ---- the runtime -----------------------------------------------------------------

    def test_sessions_are_independent_and_rewindable(self, loaded, model_facts,
                                                     prompt_tokens):
        tokens = prompt_tokens
        with rewinding_runtime(loaded, model_facts, n_sessions=2) as runtime:
            first = greedy(runtime, 0, tokens, 8)
            if model_facts.answer is not None:
                assert model_facts.answer in text_of(loaded, first)
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

    def test_a_forked_prefix_answers_like_its_source(self, loaded, model_facts,
                                                     prompt_tokens):
        tokens = prompt_tokens
        with rewinding_runtime(loaded, model_facts, n_sessions=3) as runtime:
            assert runtime.kv.fork is not ForkKind.NONE
            first = greedy(runtime, 0, tokens, 8)
            # Session 1 forks session 0's prompt less its last token, then prefills that
            # token itself: the same greedy answer follows.
            assert runtime.fork(0, 1, len(tokens) - 1)
            assert greedy(runtime, 1, tokens[-1:], 2) == first[:2]
            # Dropping the source leaves the forked prefix to session 1: its answer goes on.
            assert runtime.truncate(0, 0)
            assert greedy(runtime, 1, (first[1],), 2) == first[2:4]
            # A fork replaces whatever the target held.
            greedy(runtime, 2, tokens[:5], 1)
            assert runtime.fork(1, 2, len(tokens) - 1)
            assert greedy(runtime, 2, tokens[-1:], 2) == first[:2]

    def test_a_fork_past_what_the_source_holds_is_refused(self, loaded, model_facts,
                                                          prompt_tokens):
        tokens = prompt_tokens
        with rewinding_runtime(loaded, model_facts, n_sessions=2) as runtime:
            first = greedy(runtime, 0, tokens, 3)
            assert runtime.step([Work(1, tokens[:-1])]) == [None]  # the prompt less one
            held = len(tokens) + 2  # session 0: the prompt and two drawn tokens fed back
            assert not runtime.fork(0, 1, held + 1)
            # The target is untouched: it still answers from the prompt less one token.
            assert greedy(runtime, 1, tokens[-1:], 2) == first[:2]

    def test_kv_facts_count_bytes(self, loaded):
        with runtime_of(loaded, capacity=512, n_sessions=1, max_batch=64) as runtime:
            facts = runtime.kv
            assert facts.token_bytes > 0 and facts.max_positions >= 512
            assert facts.budget_bytes >= 512 * facts.token_bytes
            assert facts.cost(100) >= 100 * facts.token_bytes

    def test_seeded_sampling_repeats_and_seeds_matter(self, loaded):
        tokens = loaded.tokenize(prompt_of(loaded, OPEN_QUESTION), add_special=False,
                                 parse_special=True)
        with runtime_of(loaded, capacity=256, n_sessions=1, max_batch=64) as runtime:
            def draw(seed):
                sampler = runtime.new_sampler(SamplingParams(temperature=1.5, top_p=1.0,
                                                             seed=seed))
                try:
                    runtime.truncate(0, 0)
                    return runtime.step([Work(0, tokens, sampler)])[0]
                finally:
                    sampler.close()

            assert draw(42) == draw(42)
            assert len({draw(seed) for seed in range(20)}) > 1

    def test_a_mask_decides_the_draw_and_logprobs_are_the_models(self, loaded):
        """``Work.mask`` (a grammar's packed bitmask) limits the draw, in a fused step too;
        ``Sampler.last`` holds the model's own log-probabilities."""
        tokens = loaded.tokenize(prompt_of(loaded, QUESTION), add_special=True,
                                 parse_special=True)
        forced = plain_tokens(loaded, FORCED_TEXT)[-1]
        mask = np.zeros((loaded.info.n_vocab + 31) // 32, dtype=np.int32)
        mask[forced // 32] = np.int32(np.uint32(1 << (forced % 32)).view(np.int32))
        with runtime_of(loaded, capacity=512, n_sessions=2, max_batch=256) as runtime:
            free = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0,
                                                      logprobs=3))
            bound = runtime.new_sampler(SamplingParams(temperature=0.8, top_p=1.0, seed=0))
            try:
                drawn = runtime.step([Work(0, tokens, free), Work(1, tokens, bound, mask)])
                assert drawn[1] == forced
                last = free.last
                assert last.token == drawn[0] == last.top[0][0] and len(last.top) == 3
                assert last.logprob == last.top[0][1] <= 0.0
                assert [lp for _, lp in last.top] == sorted((lp for _, lp in last.top),
                                                            reverse=True)
                again = runtime.step([Work(0, (drawn[0],), free),
                                      Work(1, (forced,), bound, mask)])
                assert again[1] == forced
            finally:
                free.close()
                bound.close()

    # ---- through the engine: submit, stream, cancel, prefix reuse, fused seeds, close --

    def test_submit_stream_and_reuse_a_prefix(self, engine_model, model_facts):
        whole = engine_model.generate(QUESTION, max_tokens=8, temperature=0)
        if model_facts.answer is not None:
            assert model_facts.answer in whole.text
        assert whole.usage.completion_tokens <= 8
        chunks = list(engine_model.generate_stream(QUESTION, max_tokens=8, temperature=0))
        assert "".join(c.text for c in chunks) == whole.text
        assert chunks[-1].finish_reason and chunks[-1].usage.cached_tokens > 0  # reused

    def test_cancel_frees_the_session(self, engine_model):
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

    def test_a_seed_means_the_same_in_a_fused_batch(self, engine_model):
        def ask(seed):
            return engine_model.generate(OPEN_QUESTION, max_tokens=6, temperature=1.2,
                                         seed=seed).text

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(ask, [7, 7]))
        assert together[0] == together[1]  # each request draws from its own key

    def test_close_ends_waiting_requests(self, open_model):
        with open_model() as model:
            model.start_engine(EngineConfig(parallel=2, capacity=2048))
            stream = model.generate_stream(QUESTION, max_tokens=64, temperature=0,
                                           ignore_eos=True)
            next(stream)
        with pytest.raises(ButterError):
            list(stream)

    # ---- sampling fields: top_k, min_p, logit_bias, penalties --------------------------

    def test_top_k_1_is_deterministic_at_any_temperature(self, engine_model):
        answers = {engine_model.generate(QUESTION, max_tokens=6, temperature=1.5, top_k=1,
                                         seed=seed).text for seed in range(4)}
        assert len(answers) == 1

    def test_min_p_1_keeps_only_the_likeliest_token(self, engine_model):
        greedy_text = engine_model.generate(QUESTION, max_tokens=6, temperature=0).text
        answers = {engine_model.generate(QUESTION, max_tokens=6, temperature=1.5, top_k=0,
                                         min_p=1.0, seed=seed).text for seed in range(3)}
        assert answers == {greedy_text}

    def test_logit_bias_bans_and_forces_tokens(self, engine_model):
        loaded = engine_model.loaded
        plain = engine_model.generate(QUESTION, max_tokens=3, temperature=0, ignore_eos=True)
        first = plain_tokens(loaded, plain.text)[0]
        banned = engine_model.generate(QUESTION, max_tokens=3, temperature=0, ignore_eos=True,
                                       logit_bias={first: -100})
        assert plain_tokens(loaded, banned.text)[0] != first
        forced = plain_tokens(loaded, FORCED_TEXT)[-1]
        pushed = engine_model.generate(QUESTION, max_tokens=3, temperature=0.8, seed=1,
                                       ignore_eos=True, logit_bias={forced: 100})
        assert pushed.text == loaded.token_piece(forced).decode() * 3

    def test_a_frequency_penalty_makes_greedy_text_repeat_less(self, engine_model):
        def distinct(**penalty):
            text = engine_model.generate(REPEAT_QUESTION, max_tokens=24, temperature=0,
                                         ignore_eos=True, **penalty).text
            return len(set(plain_tokens(engine_model.loaded, text)))

        assert distinct(frequency_penalty=2.0) > distinct()
