"""Counters, gauges and latency histograms the engine keeps, exposed for Prometheus.

Only the engine thread writes. Counters are plain ints that a collector reads at scrape
time under the GIL. The gauges of what the engine holds (requests, sessions, KV) are one
frozen :class:`Gauges` record the engine replaces once per iteration and a scrape reads
once: read field by field while the engine wrote them one by one, a scrape could show
two iterations at once (0 active requests beside 2 busy sessions and their reserved
cells, the state a request leak would leave). A scrape may be one step stale, never torn.
The latency histograms are ``prometheus_client`` histograms (each guards its own
buckets) in a registry of this engine's own, never the process-wide default one: the
engines of a swap, or of a test session, never share or collide on a series.

Every series carries ``model="<served id>"``. Only the serving side knows that id
(a back end may serve a model under another name), so it is added at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import attrs
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CANCEL_PHASES = ("queued", "prefill", "decode")

# vLLM's buckets, so dashboards and alerts written for vLLM read butter unchanged.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                               640.0, 2560.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Latency:
    """Per-request timings in seconds, measured on the engine's monotonic clock."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.time_to_first_token = Histogram(
            "butter_time_to_first_token_seconds",
            "From submission to the request's first sampled token.",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram(
            "butter_time_per_output_token_seconds",
            "Between two consecutive sampled tokens of one request.",
            buckets=TIME_PER_OUTPUT_TOKEN_BUCKETS, registry=registry)
        self.e2e_request_latency = Histogram(
            "butter_e2e_request_latency_seconds",
            "From submission to the end of a request that finished (stop or length).",
            buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self.request_queue_time = Histogram(
            "butter_request_queue_time_seconds",
            "From submission until the request got a session.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=registry)


@attrs.frozen
class Gauges:
    """What the engine holds at the end of one iteration, taken together."""

    active_requests: int = 0  # requests holding a session
    queued_requests: int = 0
    sessions_busy: int = 0  # sessions leased to a request: always active_requests
    kv_reserved_cells: int = 0  # 0 whenever no request is active
    kv_used_cells: int = 0
    kv_reserved_bytes: int = 0
    kv_used_bytes: int = 0
    prompt_cache_bytes: int = 0  # host memory the saved prompts take (--cache-ram)
    prompt_cache_entries: int = 0


@attrs.define
class Metrics:
    # Counters.
    requests_total: int = 0
    requests_rejected: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    model_passes: int = 0
    draft_verifies: int = 0  # decode rows that carried drafted tokens
    draft_tokens: int = 0  # drafted tokens verified
    draft_accepted_tokens: int = 0  # drafted tokens equal to what decoding drew
    # The decode steps' (``decode_steps``) whole time, and the part inside the back end's
    # step (the native passes and the draws). The rest is the engine's own work per
    # step: planning, token bookkeeping, handing text out.
    decode_step_seconds: float = 0.0
    decode_pass_seconds: float = 0.0
    prompt_cache_saves: int = 0  # session caches copied to host memory
    prompt_cache_hits: int = 0  # prompts that loaded a saved cache
    prompt_cache_tokens: int = 0  # prompt tokens those loads held
    cancellations: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(CANCEL_PHASES, 0))
    # Gauges: what the engine holds, replaced whole once per iteration (never field by field).
    gauges: Gauges = attrs.field(factory=Gauges)
    # Gauges set once the runtime exists.
    sessions_total: int = 0
    kv_capacity_cells: int = 0
    kv_budget_bytes: int = 0
    kv_token_bytes: int = 0
    engine_alive: int = 0  # 1 from a started runtime until the engine thread ends
    step_started: float | None = None  # time.monotonic() when the step running began
    # Histograms.
    registry: CollectorRegistry = attrs.field(factory=CollectorRegistry, eq=False, repr=False)
    latency: Latency = attrs.field(
        default=attrs.Factory(lambda self: Latency(self.registry), takes_self=True),
        eq=False, repr=False)

    # One field of the current gauges each; read ``gauges`` once to take several together.
    @property
    def active_requests(self) -> int:
        return self.gauges.active_requests

    @property
    def queued_requests(self) -> int:
        return self.gauges.queued_requests

    @property
    def sessions_busy(self) -> int:
        return self.gauges.sessions_busy

    @property
    def kv_reserved_cells(self) -> int:
        return self.gauges.kv_reserved_cells

    @property
    def kv_used_cells(self) -> int:
        return self.gauges.kv_used_cells

    def render(self, *, model_id: str, fused: bool) -> str:
        """The Prometheus text exposition of every series, labelled ``model=model_id``."""
        return generate_latest(_Exposition(self, model_id=model_id, fused=fused)).decode()


class _Exposition(Collector):
    """One scrape: the ints read now, then the histograms, all with the model label."""

    def __init__(self, metrics: Metrics, *, model_id: str, fused: bool) -> None:
        self.metrics = metrics
        self.model_id = model_id
        self.fused = fused

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        g = m.gauges  # one record: every gauge below is of the same engine iteration
        yield self._counter("butter_requests_total", "Requests admitted by the engine.",
                            m.requests_total)
        yield self._counter("butter_requests_rejected_total", "Requests refused at admission.",
                            m.requests_rejected)
        yield self._counter("butter_requests_failed_total", "Requests that failed while running.",
                            m.requests_failed)
        yield self._gauge("butter_active_requests", "Requests holding a session.",
                          g.active_requests)
        yield self._gauge("butter_queued_requests", "Requests waiting in the FIFO.",
                          g.queued_requests)
        yield self._gauge("butter_sessions", "Sessions in the pool.", m.sessions_total)
        yield self._gauge("butter_sessions_busy", "Sessions leased to a request.", g.sessions_busy)
        yield self._gauge("butter_kv_capacity_cells",
                          "KV cells one request may hold (prompt plus completion).",
                          m.kv_capacity_cells)
        yield self._gauge("butter_kv_reserved_cells", "KV cells reserved by active requests.",
                          g.kv_reserved_cells)
        yield self._gauge("butter_kv_used_cells",
                          "KV cells holding tokens (active and idle sessions; a shared prefix "
                          "counts once per session that holds it).", g.kv_used_cells)
        yield self._gauge("butter_kv_budget_bytes", "KV memory every session shares, in bytes.",
                          m.kv_budget_bytes)
        yield self._gauge("butter_kv_token_bytes",
                          "Bytes one cached token costs in the KV codec in use.", m.kv_token_bytes)
        yield self._gauge("butter_kv_reserved_bytes",
                          "KV bytes reserved by active requests (a window caps each).",
                          g.kv_reserved_bytes)
        yield self._gauge("butter_kv_used_bytes", "KV bytes holding tokens, as the codec "
                          "stores them (a window caps each session).", g.kv_used_bytes)
        yield self._counter("butter_prompt_tokens_total", "Prompt tokens of admitted requests.",
                            m.prompt_tokens)
        yield self._counter("butter_cached_tokens_total",
                            "Prompt tokens reused from a session's KV.", m.cached_tokens)
        yield self._counter("butter_prompt_cache_saves_total",
                            "Session caches copied to host memory before another prompt took "
                            "their session (--cache-ram).", m.prompt_cache_saves)
        yield self._counter("butter_prompt_cache_hits_total",
                            "Prompts that loaded a cache saved in host memory.",
                            m.prompt_cache_hits)
        yield self._counter("butter_prompt_cache_tokens_total",
                            "Prompt tokens loaded from host memory instead of read (also "
                            "counted in butter_cached_tokens_total).", m.prompt_cache_tokens)
        yield self._gauge("butter_prompt_cache_bytes", "Host memory the saved prompt caches "
                          "take, in bytes.", g.prompt_cache_bytes)
        yield self._gauge("butter_prompt_cache_entries", "Prompt caches saved in host memory.",
                          g.prompt_cache_entries)
        yield self._counter("butter_generated_tokens_total", "Completion tokens sampled.",
                            m.generated_tokens)
        yield self._counter("butter_prefill_chunks_total", "Prefill chunks run.",
                            m.prefill_chunks)
        yield self._counter("butter_prefill_tokens_total", "Prompt tokens prefilled.",
                            m.prefill_tokens)
        yield self._counter("butter_decode_steps_total",
                            "Engine steps that decoded at least one token.", m.decode_steps)
        yield self._counter("butter_model_passes_total", "Native model calls (llama_decode).",
                            m.model_passes)
        yield self._counter("butter_decode_step_seconds_total",
                            "Seconds of the decode steps, from planning to handing their "
                            "text out.",
                            m.decode_step_seconds)
        yield self._counter("butter_decode_pass_seconds_total",
                            "Of those, seconds inside the back end's step: the native "
                            "model passes (prompt chunks beside the rows included) and "
                            "the draws.", m.decode_pass_seconds)
        yield self._counter("butter_speculative_verifies_total",
                            "Decode rows that verified drafted tokens (prompt lookup).",
                            m.draft_verifies)
        yield self._counter("butter_speculative_drafted_tokens_total",
                            "Drafted tokens verified.", m.draft_tokens)
        yield self._counter("butter_speculative_accepted_tokens_total",
                            "Drafted tokens equal to the token decoding drew.",
                            m.draft_accepted_tokens)
        cancellations = CounterMetricFamily("butter_cancellations_total",
                                            "Requests cancelled, by phase.",
                                            labels=("model", "phase"))
        for phase, count in m.cancellations.items():
            cancellations.add_metric((self.model_id, phase), count)
        yield cancellations
        yield self._gauge("butter_fused_batching", "1 when sessions share model passes.",
                          int(self.fused))
        yield self._gauge("butter_engine_alive",
                          "1 while the engine thread runs; 0 once it stopped or died.",
                          m.engine_alive)
        started = m.step_started  # read once: the engine thread clears it
        yield self._gauge("butter_engine_step_running_seconds",
                          "How long the engine's model step in progress has run (0 between "
                          "steps); the other gauges are of the iteration before it.",
                          0.0 if started is None else time.monotonic() - started)
        yield from _labelled(m.registry.collect(), model=self.model_id)

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        # The family drops the ``_total`` of ``name``; its sample keeps it.
        family = CounterMetricFamily(name, help_text, labels=("model",))
        family.add_metric((self.model_id,), value)
        return family

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=("model",))
        family.add_metric((self.model_id,), value)
        return family


def _labelled(families: Iterable[Metric], **labels: str) -> Iterator[Metric]:
    """``families`` (freshly collected, so ours to change) with ``labels`` on every sample.

    The ``_created`` timestamps prometheus_client adds are left out: an engine's
    histograms start with it, and ``butter_engine_alive`` already tells a restart.
    """
    for family in families:
        family.samples = [sample._replace(labels={**labels, **sample.labels})
                          for sample in family.samples if not sample.name.endswith("_created")]
        yield family
