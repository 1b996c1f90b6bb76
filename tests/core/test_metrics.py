"""``/metrics`` on the fake runtime: today's series, the latency histograms, the alive
gauge, one registry per engine, read back with prometheus_client's own parser."""

from __future__ import annotations

import sys
import threading
import time

import prometheus_client
import pytest
from fakes.runtime import FakeModel
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from butter.engine.events import Failed, Finished, SyncChannel, TextDelta
from butter.engine.records import Request
from butter.engine.scheduler import Engine, EngineConfig
from butter.generation import GenerationParams
from butter.http.app import create_app

MODEL = "fake-model"
SERIES = (
    "butter_requests_total", "butter_requests_rejected_total", "butter_requests_failed_total",
    "butter_active_requests", "butter_queued_requests", "butter_sessions",
    "butter_sessions_busy", "butter_kv_capacity_cells", "butter_kv_reserved_cells",
    "butter_kv_used_cells", "butter_prompt_tokens_total", "butter_cached_tokens_total",
    "butter_generated_tokens_total", "butter_prefill_chunks_total",
    "butter_prefill_tokens_total", "butter_decode_steps_total", "butter_model_passes_total",
    "butter_decode_step_seconds_total", "butter_decode_pass_seconds_total",
    'butter_cancellations_total{phase="queued"}', 'butter_cancellations_total{phase="prefill"}',
    'butter_cancellations_total{phase="decode"}', "butter_fused_batching", "butter_engine_alive",
    "butter_engine_step_running_seconds",
)
HISTOGRAMS = ("butter_time_to_first_token_seconds", "butter_time_per_output_token_seconds",
              "butter_e2e_request_latency_seconds", "butter_request_queue_time_seconds")


def scrape(engine: Engine) -> dict[str, float]:
    """The exposition as ``{"name{labels but model}": value}``; every sample names the model."""
    text = engine.metrics.render(model_id=MODEL, fused=engine.fused)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model") == MODEL, sample
            extra = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
            values[sample.name + (f"{{{extra}}}" if extra else "")] = sample.value
    return values


def run(engine: Engine, prompt: list[int], max_tokens: int) -> Finished | Failed:
    channel = SyncChannel()
    engine.submit(Request(prompt, GenerationParams(max_tokens=max_tokens), channel))
    while True:
        event = channel.get(timeout=10)
        if isinstance(event, (Finished, Failed)):
            return event


@pytest.fixture
def engine():
    engine = Engine(FakeModel(), EngineConfig(parallel=2, capacity=256, max_batch=64))
    engine.start()
    yield engine
    engine.stop()


def test_todays_series_and_the_histograms_count_every_request_and_token(engine):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for prompt in prompts:
        assert run(engine, prompt, max_tokens=4).reason == "length"
    metrics = scrape(engine)
    assert set(SERIES) <= metrics.keys()
    assert metrics["butter_requests_total"] == 3
    assert metrics["butter_prompt_tokens_total"] == 9
    assert metrics["butter_generated_tokens_total"] == 12
    assert metrics["butter_sessions"] == 4 and metrics["butter_kv_capacity_cells"] == 256
    assert metrics["butter_active_requests"] == 0 and metrics["butter_kv_reserved_cells"] == 0
    assert metrics["butter_fused_batching"] == 1 and metrics["butter_engine_alive"] == 1
    # One first token and one queue wait per request, three gaps between four tokens each.
    assert metrics["butter_time_to_first_token_seconds_count"] == 3
    assert metrics["butter_time_per_output_token_seconds_count"] == 9
    assert metrics["butter_e2e_request_latency_seconds_count"] == 3
    assert metrics["butter_request_queue_time_seconds_count"] == 3
    for name in HISTOGRAMS:
        assert metrics[f'{name}_bucket{{le="+Inf"}}'] == metrics[f"{name}_count"]
        assert metrics[f"{name}_sum"] >= 0
        assert not any(key.startswith(f"{name}_created") for key in metrics)


def test_decode_steps_count_their_time_and_the_pass_inside_it(engine):
    engine.model.runtime.delay = 0.005  # every step's pass takes 5 ms
    assert run(engine, [1, 2, 3], max_tokens=21).reason == "length"
    metrics = scrape(engine)
    # The first token comes with the prompt; every step after it decoded (fewer than 20:
    # some verify drafts).
    steps = metrics["butter_decode_steps_total"]
    assert 0 < steps <= 20
    passes = metrics["butter_decode_pass_seconds_total"]
    assert passes >= steps * 0.005
    assert metrics["butter_decode_step_seconds_total"] > passes


def test_a_request_cancelled_while_decoding_has_a_first_token_but_no_e2e(engine):
    engine.model.runtime.delay = 0.005  # 200 tokens: a second to cancel in
    channel = SyncChannel()
    request = Request([1, 2, 3], GenerationParams(max_tokens=200), channel)
    engine.submit(request)
    while not isinstance(channel.get(timeout=10), TextDelta):
        pass
    engine.cancel(request)
    while not isinstance(event := channel.get(timeout=10), Finished):
        pass
    assert event.reason == "cancelled"
    metrics = scrape(engine)
    assert metrics['butter_cancellations_total{phase="decode"}'] == 1
    assert metrics["butter_time_to_first_token_seconds_count"] == 1
    assert metrics["butter_request_queue_time_seconds_count"] == 1
    assert metrics["butter_e2e_request_latency_seconds_count"] == 0


def test_a_scrape_never_mixes_two_engine_iterations(engine):
    """Every scrape taken under load shows one engine iteration: as many busy sessions as
    active requests, and reserved cells only beside an active request. Read field by
    field while the engine wrote them one by one, a scrape showed 0 active requests beside
    2 busy sessions and their reserved cells: what a leaked request would look like."""
    torn, scrapes, done = [], [0], threading.Event()

    def scraper() -> None:
        while not done.is_set():
            metrics = scrape(engine)
            scrapes[0] += 1
            active, busy, reserved = (metrics["butter_active_requests"],
                                      metrics["butter_sessions_busy"],
                                      metrics["butter_kv_reserved_cells"])
            if busy != active or (active == 0) != (reserved == 0):
                torn.append((active, busy, reserved))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: tears show
    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            channels = [SyncChannel() for _ in range(4)]  # two run, two wait
            for index, channel in enumerate(channels):
                engine.submit(Request([index, 1, 2], GenerationParams(max_tokens=1 + index % 3),
                                      channel))
            for channel in channels:
                while not isinstance(channel.get(timeout=10), (Finished, Failed)):
                    pass
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert scrapes[0] > 50
    assert not torn, f"{len(torn)} of {scrapes[0]} scrapes mixed two iterations: {torn[:5]}"


def test_a_long_step_shows_as_a_step_running_not_as_held_requests(engine):
    """A step that takes long (a CPU other processes crowd) shows how long it has run;
    between steps, and once the engine idles, the gauge is 0."""
    running = "butter_engine_step_running_seconds"
    assert scrape(engine)[running] == 0
    engine.model.runtime.delay = 0.8  # one step: the prompt and the only token
    request = threading.Thread(target=run, args=(engine, [1, 2, 3], 1))
    request.start()
    longest = 0.0
    while request.is_alive():
        longest = max(longest, scrape(engine)[running])
        time.sleep(0.02)
    assert 0.3 < longest < 5
    assert scrape(engine)[running] == 0


def test_engine_alive_is_0_once_the_engine_stops(engine):
    assert scrape(engine)["butter_engine_alive"] == 1
    engine.stop()
    assert scrape(engine)["butter_engine_alive"] == 0


class Fatal(BaseException):
    """Nothing in the engine loop catches it (as a native abort would be)."""


def test_engine_alive_is_0_once_the_engine_dies(engine):
    engine.model.runtime.fail_with = Fatal()
    assert isinstance(run(engine, [1, 2], max_tokens=2), Failed)  # sent after the gauge fell
    assert engine.died and scrape(engine)["butter_engine_alive"] == 0


def test_each_engine_keeps_its_own_registry(engine):
    other = Engine(FakeModel(), EngineConfig(parallel=1, capacity=64, max_batch=32))
    other.start()
    try:
        run(engine, [1, 2, 3], max_tokens=3)
        assert scrape(engine)["butter_time_to_first_token_seconds_count"] == 1
        assert scrape(other)["butter_time_to_first_token_seconds_count"] == 0
    finally:
        other.stop()
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "butter_" not in default


class EngineBackend:
    """Just enough of a ServeBackend for ``GET /metrics`` over a real engine."""

    model_id = MODEL
    healthy = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "owned_by": "butter"}

    def model_cards(self) -> list[dict]:
        return [self.model_card()]

    def metrics_text(self) -> str:
        return self.engine.metrics.render(model_id=self.model_id, fused=self.engine.fused)

    async def generate(self, request):
        raise AssertionError("no generation here")

    async def count_tokens(self, request) -> int:
        return 0

    async def aclose(self) -> None:
        pass


def test_the_route_serves_the_exposition_with_prometheus_content_type(engine):
    run(engine, [1, 2, 3], max_tokens=2)
    with TestClient(create_app(EngineBackend(engine)), base_url="http://127.0.0.1:8000") as http:
        answer = http.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
    assert 'butter_requests_total{model="fake-model"} 1.0' in answer.text.splitlines()
    assert "# TYPE butter_e2e_request_latency_seconds histogram" in answer.text
