"""Hostile input against a real `butter serve`: the bad-input matrix and a hang-up storm.

Both drills live in `tests/support/hostile.py`; `bench/hostile.py` runs them larger. Each
test starts its own server, so its log and its memory belong to the drill alone. The
servers run `--threads 1`: ggml's two-thread pool stalls at every barrier when another
process is busy on this two-core machine, and the matrix then takes minutes, not one.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from support import hostile

FLAGS = ("--parallel", "4", "--threads", "1")
STORM = 200
RSS_GROWTH_LIMIT = 10 * 2**20


@pytest.fixture(scope="module")
def cases() -> list[hostile.Case]:
    return hostile.bad_input_cases()


def test_the_matrix_is_large_and_fixed(cases):
    assert len(cases) >= 900
    assert [case.name for case in cases] == [case.name for case in hostile.bad_input_cases()]
    assert {case.path for case in cases} >= set(hostile.POST_ROUTES)


def describe(failures: list[hostile.Failure]) -> str:
    return "\n".join(f"{f.case}: {f.status} {f.problem}: {f.excerpt[:200]}"
                     for f in failures[:30])


@pytest.mark.slow  # 900 bad requests
def test_bad_input_matrix_gets_no_5xx(start_server, cases):
    server = start_server(*FLAGS)
    report = asyncio.run(hostile.run_matrix(server.root, cases, concurrency=4))
    print(f"\nmatrix: {report.cases} cases in {report.seconds:.0f} s, "
          f"{dict(sorted(report.by_status.items()))}")
    assert report.by_class["5xx"] == 0, describe(report.server_errors)
    assert not report.server_errors, describe(report.server_errors)
    assert not report.bad_errors, describe(report.bad_errors)
    assert not report.not_refused, describe(report.not_refused)
    assert not report.broken_streams, describe(report.broken_streams)
    assert sum(report.by_class.values()) == len(cases)
    metrics = server.wait_idle(timeout=60)
    assert all(metrics[name] == 0 for name in hostile.GAUGES), metrics
    assert metrics["butter_requests_failed_total"] == 0, metrics
    assert httpx.get(f"{server.root}/health", timeout=10).text == "ok"
    assert "Traceback" not in server.log_text()


def warm_up(server) -> None:
    """A small storm first: it grows what any storm grows once (KV pages first touched,
    worker threads, allocator arenas), so the baseline RSS is not a cold one."""
    asyncio.run(hostile.hangup_storm(server.root, 50, concurrency=12, seed=-1))


@pytest.mark.slow  # a storm of 200 hang-ups
def test_hang_up_storm_leaves_no_request_session_or_memory_behind(start_server):
    server = start_server(*FLAGS)
    warm_up(server)
    before = hostile.server_rss(server.process.pid)
    saved_before = server.metrics()["butter_prompt_cache_bytes"]
    seed = random.randrange(1 << 30)
    report = asyncio.run(hostile.hangup_storm(server.root, STORM, concurrency=12, seed=seed))
    after = hostile.server_rss(server.process.pid)
    # The prompt cache keeps the caches of prompts the storm displaced (--cache-ram):
    # memory it counts and bounds, not memory leaked.
    saved = server.metrics()["butter_prompt_cache_bytes"] - saved_before
    growth = after - before - saved
    context = (f"seed {seed}, RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MB, "
               f"prompt cache +{saved / 2**20:.1f} MB, report {report.to_dict()}")
    print(f"\nstorm: {context}")
    assert report.idle, context
    assert not report.server_errors, context
    assert report.failed_requests == 0, context
    assert sum(report.cancellations.values()) > 0, context  # requests were really cut
    assert growth < RSS_GROWTH_LIMIT, context
    assert httpx.get(f"{server.root}/health", timeout=10).text == "ok"
    # Still serving, and the whole cache can be had: nothing holds a reservation.
    answer = httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert "Traceback" not in server.log_text()
