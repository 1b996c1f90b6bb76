"""``/metrics`` of a Ray Serve application: the cluster answers for itself.

Every replica of every model's deployment is asked for its counters and its own engine
exposition (the same series ``butter serve`` shows on one process). Every series is
labelled with its ``model``; the answer carries, per model:

- ``butter_cluster_*`` series per replica (``replica="<id>"``) and summed
  (``replica="total"``): requests, prompt, cached and generated tokens, the prefix-hit
  rate (cached / prompt tokens), queue length, active requests, busy sessions, free KV;
- ``butter_cluster_replicas{model}``: how many replicas answered;
- ``butter_router_decisions_total{kind}``: the ingress router's choices (affinity, new
  tenant, imbalance overrode affinity, targeted); ``butter_router_inflight{replica}``:
  the requests it counts on each replica (its load signal);
- every replica's engine series with a ``replica`` label added.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

COUNTERS = (
    ("requests", "butter_cluster_requests", "Requests admitted by the engines."),
    ("prompt_tokens", "butter_cluster_prompt_tokens", "Prompt tokens of admitted requests."),
    ("cached_tokens", "butter_cluster_cached_tokens", "Prompt tokens reused from live KV."),
    ("generated_tokens", "butter_cluster_generated_tokens", "Completion tokens sampled."),
)
GAUGES = (
    ("queue", "butter_cluster_queue_length", "Requests active or waiting."),
    ("active", "butter_cluster_active_requests", "Requests holding a session."),
    ("queued", "butter_cluster_queued_requests", "Requests waiting in the FIFO."),
    ("sessions_busy", "butter_cluster_sessions_busy", "Sessions leased to a request."),
)


def hit_rate(cached: float, prompt: float) -> float:
    return cached / prompt if prompt else 0.0


@attrs.frozen
class ModelReport:
    """One model's deployment as /metrics shows it."""

    model_id: str
    stats: list[dict[str, Any]]  # each replica's ``replica_stats``
    decisions: dict[str, int] = attrs.Factory(dict)  # its router's choices by kind
    inflight: dict[str, int] = attrs.Factory(dict)  # its router's count per replica


def cluster_exposition(reports: Iterable[ModelReport]) -> str:
    """The Prometheus text of every model's ``reports``."""
    return generate_latest(_Cluster(list(reports))).decode()


def _rows(stats: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each replica's row by id, then their sum as ``total``."""
    total: dict[str, Any] = {}
    for one in sorted(stats, key=lambda s: s["replica"]):
        yield one["replica"], one
        for key, value in one.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    yield "total", total


class _Cluster(Collector):
    def __init__(self, reports: list[ModelReport]) -> None:
        self.reports = reports

    def collect(self) -> Iterator[Metric]:
        labels = ("model", "replica")
        rows = [(report.model_id, replica, row) for report in self.reports
                for replica, row in _rows(report.stats)]
        replicas = GaugeMetricFamily("butter_cluster_replicas", "Replicas that answered.",
                                     labels=("model",))
        for report in self.reports:
            replicas.add_metric((report.model_id,), len(report.stats))
        yield replicas
        for key, name, text in COUNTERS:
            family = CounterMetricFamily(name, text, labels=labels)
            for model, replica, row in rows:
                family.add_metric((model, replica), row.get(key, 0))
            yield family
        for key, name, text in GAUGES:
            family = GaugeMetricFamily(name, text, labels=labels)
            for model, replica, row in rows:
                family.add_metric((model, replica), row.get(key, 0))
            yield family
        rate = GaugeMetricFamily("butter_cluster_prefix_hit_rate",
                                 "Cached / prompt tokens since the replica started.",
                                 labels=labels)
        for model, replica, row in rows:
            rate.add_metric((model, replica),
                            hit_rate(row.get("cached_tokens", 0), row.get("prompt_tokens", 0)))
        yield rate
        each = [(model, replica, row) for model, replica, row in rows if replica != "total"]
        free = GaugeMetricFamily("butter_cluster_free_kv_ratio",
                                 "KV memory not reserved by active requests, as a fraction.",
                                 labels=labels)
        for model, replica, row in each:
            free.add_metric((model, replica), row.get("free_kv", 0.0))
        yield free
        pid = GaugeMetricFamily("butter_cluster_replica_pid", "The replica's process id.",
                                labels=labels)
        for model, replica, row in each:
            pid.add_metric((model, replica), row.get("pid", 0))
        yield pid
        decided = CounterMetricFamily("butter_router_decisions",
                                      "Routing decisions of the ingress's prefix router.",
                                      labels=("model", "kind"))
        for report in self.reports:
            for kind, value in sorted(report.decisions.items()):
                decided.add_metric((report.model_id, kind), value)
        yield decided
        routed = GaugeMetricFamily("butter_router_inflight",
                                   "Requests the ingress's router has on each replica (its "
                                   "load signal).", labels=labels)
        for report in self.reports:
            for replica, count in sorted(report.inflight.items()):
                routed.add_metric((report.model_id, replica), count)
        yield routed
        yield from merge_replicas((row["replica"], row.get("exposition", ""))
                                  for _model, replica, row in each)


def merge_replicas(expositions: Iterable[tuple[str, str]]) -> Iterator[Metric]:
    """Each replica's engine series, one family per name, with ``replica`` added."""
    families: dict[str, Metric] = {}
    for replica, text in expositions:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            merged.samples.extend(sample._replace(labels={**sample.labels, "replica": replica})
                                  for sample in family.samples)
    yield from families.values()
