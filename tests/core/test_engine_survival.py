"""One request cannot stop the engine; an engine that dies anyway says so."""

from fakes.runtime import FakeModel

from butter.engine.events import Admitted, Failed, Finished, SyncChannel, TextDelta
from butter.engine.records import Request
from butter.engine.scheduler import Engine, EngineConfig
from butter.errors import InternalError
from butter.generation import GenerationParams


def run(engine: Engine, prompt, max_tokens: int = 3) -> list:
    channel = SyncChannel()
    engine.submit(Request(prompt, GenerationParams(max_tokens=max_tokens), channel))
    events = []
    while not events or not isinstance(events[-1], (Finished, Failed)):
        events.append(channel.get(timeout=10))
    return events


def started() -> tuple[Engine, FakeModel]:
    model = FakeModel()
    engine = Engine(model, EngineConfig(parallel=2, capacity=256, max_batch=64))
    engine.start()
    return engine, model


def test_a_request_that_breaks_admission_fails_alone():
    engine, _ = started()
    try:
        broken = run(engine, None)  # not a token list: a bug in whoever built it
        assert isinstance(broken[-1], Failed) and isinstance(broken[-1].error, InternalError)
        events = run(engine, [1, 2, 3])
        assert isinstance(events[0], Admitted) and isinstance(events[-1], Finished)
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "xxx"
        assert engine.alive and not engine.died
    finally:
        engine.stop()


def test_a_failing_pass_fails_its_requests_and_the_engine_goes_on():
    engine, model = started()
    try:
        model.runtime.fail_with = RuntimeError("native failure")
        assert isinstance(run(engine, [1, 2])[-1], Failed)
        model.runtime.fail_with = None
        assert isinstance(run(engine, [1, 2])[-1], Finished)
        assert not engine.died
    finally:
        engine.stop()


class Fatal(BaseException):
    """Something no handler in the loop catches (as a native abort would be)."""


def test_an_engine_that_dies_fails_its_requests_and_reports_it():
    engine, model = started()
    model.runtime.fail_with = Fatal()
    events = run(engine, [1, 2])
    assert isinstance(events[-1], Failed)
    engine._thread.join(5)
    assert engine.died and not engine.alive
    after = run(engine, [1])  # later requests fail at once instead of hanging
    assert isinstance(after[-1], Failed)
