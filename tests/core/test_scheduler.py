"""The engine on a fake runtime: eviction, forks, the non-fused path, models that
cannot rewind, and a failing pass, without a model."""

from __future__ import annotations

import queue
import random
import time

import pytest
from fakes.runtime import FakeModel, ToyModel

from butter.backend import ForkKind, TruncateKind
from butter.engine.events import Admitted, Failed, Finished, SyncChannel
from butter.engine.records import Request
from butter.engine.scheduler import Engine, EngineConfig
from butter.generation import GenerationParams


class Client:
    """One submitted request and its events."""

    def __init__(self, engine: Engine, prompt: list[int], max_tokens: int = 2) -> None:
        self.channel = SyncChannel()
        self.request = Request(prompt, GenerationParams(max_tokens=max_tokens), self.channel)
        engine.submit(self.request)
        self.events: list = []

    def result(self):
        while not self.events or not isinstance(self.events[-1], (Finished, Failed)):
            self.events.append(self.channel.get(timeout=10))
        return self.events[-1]

    @property
    def cached(self) -> int:
        finished = self.result()
        assert isinstance(finished, Finished), finished
        return finished.usage.cached_tokens


@pytest.fixture
def engine_for():
    engines: list[Engine] = []

    def start(model: FakeModel, **config) -> Engine:
        config = {"parallel": 2, "capacity": 64, "max_batch": 32, **config}
        engine = Engine(model, EngineConfig(**config))
        engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.stop()


def test_idle_caches_are_evicted_least_recently_used_first(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=1, n_sessions=3, capacity=64)
    runtime = model.runtime
    Client(engine, list(range(100, 120))).result()  # 22 tokens held after it
    time.sleep(0.01)
    Client(engine, list(range(200, 220))).result()
    held = sorted(len(tokens) for tokens in runtime.held)
    assert held == [0, 21, 21]
    # 40 tokens of prompt + 2: only one idle cache may stay; the older one goes.
    Client(engine, list(range(300, 340))).result()
    assert runtime.held[0] == [] and len(runtime.held[1]) == 21


def test_a_longer_prefix_is_forked_from_a_busy_session(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=2, capacity=256)
    model.runtime.delay = 0.005
    stem = list(range(1, 41))
    first = Client(engine, stem + [50], max_tokens=60)
    while len(model.runtime.steps) < 3:  # its prompt is in and it is decoding
        time.sleep(0.001)
    second = Client(engine, stem + [60])
    assert second.cached == 40 and first.result().reason == "length"
    assert model.runtime.forks == [(0, 1, 40)]


def test_a_failed_fork_leaves_the_leased_session_its_own_prefix(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=2, n_sessions=3, capacity=256)
    model.runtime.delay = 0.005
    busy = Client(engine, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=80)
    while len(model.runtime.steps) < 2:
        time.sleep(0.001)
    assert Client(engine, [1, 2, 3, 60], max_tokens=1).cached == 3  # forked from the busy one
    model.runtime.fork_works = False
    # It leases the idle session holding 1,2,3; the busy one holds a longer prefix, but
    # the fork fails: the request keeps the three tokens its session had.
    third = Client(engine, [1, 2, 3, 4, 5, 6, 7, 8, 50], max_tokens=1)
    assert third.cached == 3
    assert len(model.runtime.forks) == 1 and busy.result().reason == "length"


def test_a_saved_prompt_that_holds_more_is_loaded_instead_of_a_fork(engine_for):
    """One copy per admission: a fork's copy may land after a load (llama.cpp copies
    streams at the next decode), so the longer of the two is made, not both."""
    model = FakeModel(saves=True)
    engine = engine_for(model, parallel=2, capacity=256)
    model.runtime.delay = 0.005
    stem = [1, 2, 3, 4]
    asked = stem + list(range(10, 50))
    assert Client(engine, asked).cached == 0
    # It takes the session that held ``asked`` (4 tokens shared): that one is saved.
    busy = Client(engine, stem + list(range(60, 100)), max_tokens=60)
    while len(model.runtime.steps) < 4:
        time.sleep(0.001)
    again = Client(engine, asked, max_tokens=1)
    assert again.cached == len(asked) - 1
    assert model.runtime.forks == [] and model.runtime.restores == [(1, len(asked) + 1)]
    assert busy.result().reason == "length"


def test_without_fused_batching_each_session_runs_its_own_pass(engine_for):
    model = FakeModel(fusable=False)
    engine = engine_for(model, parallel=2)
    a, b = Client(engine, [1, 2, 3], max_tokens=5), Client(engine, [4, 5, 6], max_tokens=5)
    assert isinstance(a.result(), Finished) and isinstance(b.result(), Finished)
    assert all(len(step) == 1 for step in model.runtime.steps)


def test_fused_batching_puts_sessions_in_one_pass(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=2)
    a, b = Client(engine, [1, 2, 3], max_tokens=20), Client(engine, [4, 5, 6], max_tokens=20)
    a.result(), b.result()
    assert any(len(step) == 2 for step in model.runtime.steps)


def test_state_that_cannot_rewind_is_reused_whole_or_not_at_all(engine_for):
    model = FakeModel(fork=ForkKind.NONE, truncate=TruncateKind.NEVER)
    engine = engine_for(model, parallel=1, n_sessions=1)
    Client(engine, [1, 2, 3, 4]).result()  # holds 1,2,3,4,7
    assert Client(engine, [1, 2, 3, 4, 7, 7, 9]).cached == 5  # the whole cache is a prefix
    assert Client(engine, [1, 2, 3, 8]).cached == 0  # departs inside it: rebuilt
    assert model.runtime.held[0][:4] == [1, 2, 3, 8]


def test_a_failing_pass_is_retried_in_halves_and_fails_only_its_culprit(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=4, capacity=256)
    poisoned = {2}
    model.runtime.fail_when = lambda work: any(item.session in poisoned for item in work)
    clients = [Client(engine, [10 * i + 1, 10 * i + 2], max_tokens=3) for i in range(4)]
    results = [client.result() for client in clients]
    failed = [i for i, result in enumerate(results) if isinstance(result, Failed)]
    assert len(failed) == 1
    assert sum(isinstance(result, Finished) for result in results) == 3
    assert engine.alive and not engine.died


def test_admission_reserves_in_bytes_and_the_fifo_waits_for_room(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=2, capacity=40)
    big = Client(engine, list(range(1, 21)), max_tokens=15)  # 35 of 40 tokens
    small = Client(engine, [1, 2, 3, 4, 5, 6], max_tokens=4)  # 10: waits for room
    assert isinstance(big.result(), Finished) and isinstance(small.result(), Finished)
    assert isinstance(small.events[0], Admitted)
    # It waited: no step fed both sessions at once.
    assert all(len(step) == 1 for step in model.runtime.steps)


def test_short_prompts_prefill_before_a_long_one_which_then_goes_first(engine_for):
    model = FakeModel()
    engine = engine_for(model, parallel=4, capacity=256, max_batch=64, prefill_chunk=16)
    model.runtime.delay = 0.05
    busy = Client(engine, [9, 9, 9], max_tokens=40)  # keeps the engine stepping
    while not model.runtime.steps:
        time.sleep(0.01)
    long = Client(engine, list(range(100, 140)), max_tokens=2)
    shorts = [Client(engine, list(range(s, s + 10)), max_tokens=2) for s in (200, 300)]
    for client in (long, *shorts):
        assert isinstance(client.result(), Finished)
    busy.result()
    sizes = [[n for _, n in step if n > 3] for step in model.runtime.steps]
    first = next(i for i, step in enumerate(sizes) if step)
    # The step that ends the two 10-token prompts takes no chunk of the long one, though
    # it would fit: their first tokens wait for their own prompts only...
    assert sizes[first] == [10, 10]
    # ...and goes first in the next step, then its chunks follow one a step.
    assert sizes[first + 1:first + 4] == [[16], [16], [8]]


def test_every_request_ends_once_and_nothing_stays_held_whatever_happens(engine_for):
    """Rounds of random requests on the toy model (cached prompts asked again exactly,
    prompts that quote themselves so drafts get verified, n choices of one prompt, answers
    that end at their end token or at max_tokens), cancelled at random moments, with model
    passes failing now and then: every request gets one end (Finished or Failed) and
    nothing after it, and once a round is over the engine holds no request, session or
    reserved cell. (The engine state a stuck stream would need.)"""
    rng = random.Random(20261204)
    model = ToyModel(delay=0.0005)
    engine = engine_for(model, parallel=4, capacity=2048, max_batch=64, prefill_chunk=16)
    failures = random.Random(1)
    model.runtime.fail_when = lambda work: failures.random() < 0.02
    stems = [[rng.randrange(256) for _ in range(rng.randint(20, 120))] for _ in range(4)]
    quote = list(b"lmno" * 12)
    for _ in range(8):
        requests = []
        for _ in range(rng.randint(2, 10)):
            stem = rng.choice(stems)
            prompt = rng.choice((stem, stem + quote, stem + [rng.randrange(256)]))
            params = GenerationParams(max_tokens=rng.choice((1, 4, 30)),
                                      ignore_eos=rng.random() < 0.5,
                                      temperature=rng.choice((0.0, 0.8)), seed=7)
            for _ in range(rng.choice((1, 1, 2, 3))):  # n choices: the same prompt again
                requests.append(Request(list(prompt), params, SyncChannel()))
                engine.submit(requests[-1])
        for request in rng.sample(requests, len(requests) // 3):
            time.sleep(rng.uniform(0, 0.01))
            engine.cancel(request)
        for request in requests:
            ends = []
            while not ends:
                event = request.channel.get(timeout=10)
                ends += [event] if isinstance(event, (Finished, Failed)) else []
            with pytest.raises(queue.Empty):
                request.channel.get(timeout=0.001)
        gauges = engine.metrics.gauges  # the iteration that sent the last end, or a later one
        assert (gauges.active_requests, gauges.queued_requests, gauges.sessions_busy,
                gauges.kv_reserved_cells) == (0, 0, 0, 0)
    assert model.runtime.verifies  # drafts were verified along the way
