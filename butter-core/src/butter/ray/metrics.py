"""``/metrics`` of a Ray Serve deployment: the cluster answers for itself.

Every replica is asked for its counters and its own engine exposition (the same series
``butter serve`` shows on one process). The answer carries:

- ``butter_cluster_*`` series per replica (``replica="<id>"``) and summed
  (``replica="total"``): requests, prompt, cached and generated tokens, the prefix-hit
  rate (cached / prompt tokens), queue length, active requests, busy sessions, free KV;
- ``butter_cluster_replicas``: how many replicas answered;
- ``butter_router_decisions_total{kind}``: the ingress router's choices (affinity, new
  tenant, imbalance overrode affinity, targeted); ``butter_router_inflight{replica}``:
  the requests it counts on each replica (its load signal);
- every replica's engine series with a ``replica`` label added.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

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


def cluster_exposition(stats: list[dict[str, Any]], *, model_id: str,
                       decisions: dict[str, int], inflight: dict[str, int] | None = None
                       ) -> str:
    """The Prometheus text of ``stats`` (each replica's ``replica_stats``)."""
    return generate_latest(_Cluster(stats, model_id, decisions, inflight or {})).decode()


class _Cluster(Collector):
    def __init__(self, stats: list[dict[str, Any]], model_id: str,
                 decisions: dict[str, int], inflight: dict[str, int]) -> None:
        self.stats = sorted(stats, key=lambda s: s["replica"])
        self.model_id = model_id
        self.decisions = decisions
        self.inflight = inflight

    def _rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        total: dict[str, Any] = {}
        for one in self.stats:
            yield one["replica"], one
            for key, value in one.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        yield "total", total

    def collect(self) -> Iterator[Metric]:
        labels = ("model", "replica")
        rows = list(self._rows())
        replicas = GaugeMetricFamily("butter_cluster_replicas", "Replicas that answered.",
                                     labels=("model",))
        replicas.add_metric((self.model_id,), len(self.stats))
        yield replicas
        for key, name, text in COUNTERS:
            family = CounterMetricFamily(name, text, labels=labels)
            for replica, row in rows:
                family.add_metric((self.model_id, replica), row.get(key, 0))
            yield family
        for key, name, text in GAUGES:
            family = GaugeMetricFamily(name, text, labels=labels)
            for replica, row in rows:
                family.add_metric((self.model_id, replica), row.get(key, 0))
            yield family
        rate = GaugeMetricFamily("butter_cluster_prefix_hit_rate",
                                 "Cached / prompt tokens since the replica started.",
                                 labels=labels)
        for replica, row in rows:
            rate.add_metric((self.model_id, replica),
                            hit_rate(row.get("cached_tokens", 0), row.get("prompt_tokens", 0)))
        yield rate
        free = GaugeMetricFamily("butter_cluster_free_kv_ratio",
                                 "KV cells not reserved by active requests, as a fraction.",
                                 labels=labels)
        for replica, row in rows[:-1]:
            free.add_metric((self.model_id, replica), row.get("free_kv", 0.0))
        yield free
        pid = GaugeMetricFamily("butter_cluster_replica_pid", "The replica's process id.",
                                labels=labels)
        for replica, row in rows[:-1]:
            pid.add_metric((self.model_id, replica), row.get("pid", 0))
        yield pid
        decided = CounterMetricFamily("butter_router_decisions",
                                      "Routing decisions of the ingress's prefix router.",
                                      labels=("model", "kind"))
        for kind, value in sorted(self.decisions.items()):
            decided.add_metric((self.model_id, kind), value)
        yield decided
        routed = GaugeMetricFamily("butter_router_inflight",
                                   "Requests the ingress's router has on each replica (its "
                                   "load signal).", labels=labels)
        for replica, count in sorted(self.inflight.items()):
            routed.add_metric((self.model_id, replica), count)
        yield routed
        yield from merge_replicas((row["replica"], row.get("exposition", ""))
                                  for row in self.stats)


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
