"""The prefix router's key and tables, and the cluster exposition, without a cluster."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from butter.ray.metrics import ModelReport, cluster_exposition
from butter.ray.router import PrefixTable, block_hashes, routing_key
from butter.wire.anthropic import parse_messages_request
from butter.wire.openai import parse_chat_completion

SYSTEM = "You are the archivist. " * 20
TOOLS = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]


def test_openai_and_anthropic_bodies_key_alike_system_first():
    openai = parse_chat_completion({"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which day?"}]})
    anthropic = parse_messages_request({"model": "m", "max_tokens": 5, "system": SYSTEM,
                                        "messages": [{"role": "user", "content": "Which day?"}]})
    assert routing_key(openai) == routing_key(anthropic)
    assert routing_key(openai).startswith("system\x1f" + SYSTEM)


def test_tools_come_after_the_system_prompt_and_before_the_conversation():
    request = parse_chat_completion({"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "system", "content": SYSTEM}]})
    key = routing_key(request)
    assert key.index(SYSTEM) < key.index('"look"') < key.index("user\x1fHi")


def test_a_longer_conversation_extends_the_same_blocks():
    first = parse_chat_completion({"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Q1"}]})
    later = parse_chat_completion({"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]})
    short, long = block_hashes(routing_key(first), 64), block_hashes(routing_key(later), 64)
    assert short and long[:len(short)] == short
    table = PrefixTable(max_blocks=100)
    table.insert(short)
    assert table.matched(long) == len(short)
    other = block_hashes(routing_key(parse_chat_completion({"model": "m", "messages": [
        {"role": "system", "content": "Another house. " * 30}]})), 64)
    assert table.matched(other) == 0


def test_a_table_forgets_its_least_recent_blocks_first():
    table = PrefixTable(max_blocks=3)
    table.insert([1, 2, 3])
    table.insert([1])  # used again
    table.insert([4])
    assert table.matched([1]) == 1 and table.matched([2]) == 0 and len(table) == 3


def test_cluster_exposition_has_each_replica_and_the_total_per_model():
    engine = ('# HELP butter_requests_total Requests.\n# TYPE butter_requests_total counter\n'
              'butter_requests_total{model="m"} 3.0\n')
    stats = [{"replica": "a", "requests": 3, "prompt_tokens": 100, "cached_tokens": 80,
              "queue": 1, "free_kv": 0.5, "pid": 11, "exposition": engine},
             {"replica": "b", "requests": 1, "prompt_tokens": 100, "cached_tokens": 0,
              "queue": 0, "free_kv": 1.0, "pid": 12, "exposition": engine}]
    other = [{"replica": "c", "requests": 5, "prompt_tokens": 10, "cached_tokens": 5,
              "exposition": engine.replace('model="m"', 'model="n"')}]
    text = cluster_exposition([
        ModelReport("m", stats, decisions={"affinity": 2}, inflight={"a": 1, "b": 0}),
        ModelReport("n", other, decisions={"new": 1})])
    samples = {(s.name, s.labels.get("model"), s.labels.get("replica") or s.labels.get("kind")
                ): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("butter_cluster_requests_total", "m", "total")] == 4
    assert samples[("butter_cluster_prefix_hit_rate", "m", "a")] == 0.8
    assert samples[("butter_cluster_prefix_hit_rate", "m", "total")] == 0.4
    assert samples[("butter_requests_total", "m", "b")] == 3  # each engine's own series
    assert samples[("butter_router_inflight", "m", "a")] == 1
    # A second model's deployment: its own rows, total and router counts.
    assert samples[("butter_cluster_replicas", "m", None)] == 2
    assert samples[("butter_cluster_replicas", "n", None)] == 1
    assert samples[("butter_cluster_requests_total", "n", "total")] == 5
    assert samples[("butter_router_decisions_total", "n", "new")] == 1
    assert samples[("butter_requests_total", "n", "c")] == 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def butter_serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "butter", "serve", "--model", "smollm2",
                           "--port", str(free_port()), *flags],
                          capture_output=True, text=True, timeout=120)


def test_ray_router_without_replicas_is_a_usage_error():
    done = butter_serve("--ray-router", "pow2")
    assert done.returncode == 2
    assert "--ray-router: applies to --replicas or --ray-address" in done.stderr


def test_more_replica_cpus_than_cores_is_refused_before_starting_ray():
    cores = os.cpu_count() or 1
    done = butter_serve("--replicas", str(cores + 1), "--threads", "1")
    assert done.returncode == 2
    assert f"each need {cores + 1} CPUs; this machine has {cores}" in done.stderr


def test_several_models_without_replicas_is_a_usage_error_naming_the_fix():
    done = butter_serve("--model", "smollm2")
    assert done.returncode == 2
    assert "--model: 2 models given; one process serves one. Serve several behind one " \
        "address with --replicas N" in done.stderr


def test_alias_and_one_id_twice_are_usage_errors_with_several_models():
    done = butter_serve("--model", "other", "--replicas", "1", "--alias", "mine")
    assert done.returncode == 2 and "--alias: names the one --model" in done.stderr
    done = butter_serve("--model", "smollm2", "--replicas", "1", "--threads", "1")
    assert done.returncode == 2
    assert "'smollm2' is served as 'smollm2', which an earlier --model already is" \
        in done.stderr


def test_every_model_s_replicas_count_against_the_cores(tiny_qwen35_gguf):
    cores = os.cpu_count() or 1
    done = butter_serve("--model", str(tiny_qwen35_gguf), "--replicas", str(cores),
                        "--threads", "1")
    assert done.returncode == 2
    assert (f"2 models × {cores} replicas of 1 CPU(s) each need {2 * cores} CPUs; this "
            f"machine has {cores}") in done.stderr


class _Stream:
    """A handle call's stream: ``items`` then ``error`` (what Serve's generator raises)."""

    def __init__(self, items: list, error: BaseException | None = None,
                 hang: bool = False) -> None:
        self.items, self.error, self.hang, self.cancelled = list(items), error, hang, False

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.hang:
            await asyncio.sleep(3600)
        raise self.error or StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def _delta():
    from butter.chat.recovery import ContentDelta

    return ContentDelta(text="hi")


def test_a_replica_dying_under_its_stream_is_replica_lost_not_a_cut_connection():
    # Serve raises CancelledError in the ingress when the replica's task was cancelled
    # by its actor's death: the stream must end with replica_lost (an error event).
    from butter.errors import ReplicaLostError
    from butter.ray.remote import RemoteGeneration

    async def read() -> list:
        generation = RemoteGeneration(_Stream([_delta()], asyncio.CancelledError()))
        seen = []
        with pytest.raises(ReplicaLostError):
            async for delta in generation:
                seen.append(delta)
        return seen

    assert len(asyncio.run(read())) == 1


def test_a_cancelled_reader_still_cancels_and_is_not_called_lost():
    from butter.ray.remote import RemoteGeneration

    async def read(generation: RemoteGeneration) -> None:
        async for _ in generation:
            pass

    async def main() -> _Stream:
        stream = _Stream([_delta()], hang=True)
        task = asyncio.create_task(read(RemoteGeneration(stream)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stream

    assert asyncio.run(main()).cancelled  # the replica's call is cancelled too


def test_a_stale_full_kv_report_does_not_pass_over_a_replica_whose_requests_ended():
    # Serve polls record_routing_stats each second: a report from the moment a replica
    # was full must not move its tenants away once this router's requests there ended.
    from types import SimpleNamespace

    from butter.ray.router import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router._deployment_id = None
    router.initialize_state(imbalance=4)
    rid = "replica-a"  # a ReplicaID stand-in: hashable
    full = {"queue": 4, "active": 4, "free_kv": 0.0}
    replica = SimpleNamespace(replica_id=rid, routing_stats=full)
    router._last_seen[rid] = 100.0  # a request of ours ended just now
    assert router.load(replica, now=100.5) == 0  # stale: nothing of ours is there
    router._inflight[rid] = 4
    assert router.load(replica, now=100.5) == 8  # current: full, passed over
    router._inflight[rid] = 1
    assert router.load(replica, now=100.5) == 1  # the report predates three releases


def test_free_kv_is_of_the_shared_kv_budget():
    # --parallel 8 over 8,192 cells: each session may hold 1,024 (kv_capacity_cells).
    # Two active 520-token requests leave most of the memory free; measured against one
    # session's 1,024 cells they read as full, and the router moved tenants off.
    from types import SimpleNamespace

    from butter.engine.metrics import Gauges, Metrics
    from butter.ray.remote import replica_stats

    token_bytes = 36_864
    metrics = Metrics(kv_capacity_cells=1024, kv_budget_bytes=8192 * token_bytes,
                      gauges=Gauges(active_requests=2, sessions_busy=2, kv_reserved_cells=1040,
                                    kv_reserved_bytes=1040 * token_bytes))
    backend = SimpleNamespace(current=SimpleNamespace(engine=SimpleNamespace(metrics=metrics)),
                              healthy=True, metrics_text=lambda: "")
    stats = replica_stats(backend, "replica-a")
    assert stats["free_kv"] == pytest.approx(1 - 1040 / 8192)
