"""Admission on a tight cache: nothing leaks when clients vanish, and the FIFO waits for room.

One real `butter serve --parallel 2 --max-context 2048 --kv-layout shared` on the shipped
SmolLM2: both sessions draw on one pool, so "fits later" and "never fits" are about that pool.
(The default per-session layout never waits for room; `test_hostile` covers its hang-ups.)
The leak test hangs up on requests at random points of their life, then proves the server is
back to idle by its gauges and by admitting one request that needs the whole cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerProcess
from helpers import notes, wait_for

CAPACITY = 2048
CHAT = "/chat/completions"


def chat_body(user: str, **fields) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": user}], **fields}


@pytest.fixture(scope="module")
def tight() -> Iterator[ServerProcess]:
    # Small prefill chunks next to decoding lanes make "mid-prefill" a window worth hitting.
    process = ServerProcess("--parallel", "2", "--max-context", str(CAPACITY),
                            "--prefill-chunk", "32", "--kv-layout", "shared")
    warm_up = httpx.post(process.base_url + CHAT, json=chat_body("Hi.", max_tokens=1), timeout=300)
    assert warm_up.status_code == 200  # serving before clients start hanging up on it
    yield process
    process.stop()


async def request_then_hang_up(url: str, body: dict, *, after_seconds: float | None = None,
                               after_chunks: int | None = None) -> str:
    """Run one request; drop the connection after ``after_seconds`` or, when streaming, after
    ``after_chunks`` chunks of text. Return "completed" or "hung up"."""

    async def run() -> str:
        async with httpx.AsyncClient(timeout=300) as client:
            if not body.get("stream"):
                response = await client.post(url, json=body)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
                return "completed"
            async with client.stream("POST", url, json=body) as response:
                assert response.status_code == 200, await response.aread()
                finish, seen = None, 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for choice in chunk["choices"]:
                        finish = choice["finish_reason"] or finish
                        seen += bool(choice["delta"].get("content"))
                    if finish is None and after_chunks is not None and seen >= after_chunks:
                        return "hung up"  # leaving the blocks closes the connection mid-answer
                assert finish in ("stop", "length"), finish
                return "completed"

    if after_seconds is None:
        return await run()
    try:
        return await asyncio.wait_for(run(), after_seconds)
    except TimeoutError:  # wait_for cancelled the request: the client closed the connection
        return "hung up"


async def random_hang_ups(url: str, rng: random.Random, count: int) -> list[str]:
    prompts = (lambda topic: f"Tell me about {topic} in two sentences.",
               lambda topic: notes(30, topic) + "\nSummarise the notes.")  # ~30 or ~330 tokens
    slots = asyncio.Semaphore(5)  # more clients than lanes: some always wait in the FIFO

    async def one(index: int) -> str:
        stream = rng.random() < 0.5
        body = chat_body(rng.choice(prompts)(f"topic {index}"), stream=stream,
                         max_tokens=rng.randint(1, 48), temperature=rng.choice((0, 0.8)),
                         ignore_eos=rng.random() < 0.3)
        cut = rng.choice(("never", "at once", "sending", "later", "mid-answer"))
        when = {"never": {}, "at once": {"after_seconds": 0},
                "sending": {"after_seconds": rng.uniform(0.001, 0.05)},
                "later": {"after_seconds": rng.uniform(0.05, 3)},  # queued, prefill or decode
                "mid-answer": ({"after_chunks": rng.randint(1, 6)} if stream
                               else {"after_seconds": rng.uniform(0.5, 5)})}[cut]
        async with slots:
            await asyncio.sleep(rng.uniform(0, 0.3))
            return f"{cut}: " + await request_then_hang_up(url, body, **when)

    return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.slow  # 40 random hang-ups and their answers
def test_random_hang_ups_leak_no_session_or_reservation(tight):
    before = tight.wait_idle()
    seed = random.randrange(1 << 30)
    outcomes = asyncio.run(random_hang_ups(tight.base_url + CHAT, random.Random(seed), 40))
    metrics = tight.wait_idle(timeout=120)
    context = f"seed {seed}, outcomes {outcomes}, metrics {metrics}"
    assert metrics["butter_active_requests"] == 0, context
    assert metrics["butter_queued_requests"] == 0, context
    assert metrics["butter_sessions_busy"] == 0, context
    assert metrics["butter_kv_reserved_cells"] == 0, context
    assert metrics["butter_kv_used_cells"] <= CAPACITY, context
    failed = "butter_requests_failed_total"
    assert metrics[failed] == before[failed], context
    cancelled = sum(metrics[f'butter_cancellations_total{{phase="{phase}"}}']
                    - before[f'butter_cancellations_total{{phase="{phase}"}}']
                    for phase in ("queued", "prefill", "decode"))
    assert cancelled > 0, context  # the run did cut requests short

    # A request reserving the whole cache is admitted only if nothing else holds any of it.
    prompt = notes(60, "the full cache") + "\nReply with one short sentence."
    probe = httpx.post(tight.base_url + CHAT, json=chat_body(prompt, max_tokens=1), timeout=300)
    prompt_tokens = probe.json()["usage"]["prompt_tokens"]
    body = chat_body(prompt, max_tokens=CAPACITY - prompt_tokens, temperature=0, stop=["\n", "."])
    full = httpx.post(tight.base_url + CHAT, json=body, timeout=120)
    assert full.status_code == 200, full.text
    assert full.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert tight.wait_idle()["butter_kv_reserved_cells"] == 0


def open_stream(client: httpx.Client, server: ServerProcess, body: dict) -> httpx.Response:
    request = client.build_request("POST", server.base_url + CHAT, json={**body, "stream": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return response


def content_chunks(lines: Iterator[str], count: int) -> int:
    """Read the stream until ``count`` chunks carrying text arrived; return how many did."""
    seen = 0
    for line in lines:
        if line.startswith("data: {") and \
                json.loads(line[6:])["choices"][0]["delta"].get("content"):
            seen += 1
            if seen == count:
                break
    return seen


def test_request_that_can_never_fit_is_refused_at_once(tight):
    tight.wait_idle()
    with httpx.Client(timeout=300) as client:
        running = open_stream(client, tight, chat_body("Tell me a long story.", max_tokens=1500,
                                                       ignore_eos=True))
        lines = running.iter_lines()
        assert content_chunks(lines, 2) == 2
        start = time.monotonic()
        refused = httpx.post(tight.base_url + CHAT, timeout=60,
                             json=chat_body("Hello.", max_tokens=CAPACITY))
        assert time.monotonic() - start < 10
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        # The running request carries on.
        assert tight.metrics()["butter_active_requests"] == 1
        assert content_chunks(lines, 3) == 3
        running.close()
    tight.wait_idle()


def test_request_that_fits_later_waits_in_fifo_and_completes(tight):
    tight.wait_idle()
    with httpx.Client(timeout=300) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = open_stream(client, tight, chat_body("Tell me a long story.", max_tokens=400,
                                                       ignore_eos=True))
        lines = running.iter_lines()
        assert content_chunks(lines, 2) == 2
        # Fits the cache alone, not next to the running request's reservation.
        big = pool.submit(httpx.post, tight.base_url + CHAT, timeout=300, json=chat_body(
            "Say hello.", max_tokens=CAPACITY - 100, temperature=0, stop=["\n"]))
        wait_for(tight, lambda m: m["butter_queued_requests"] == 1, "the big request queued")
        # A small one behind it would fit now, but FIFO keeps it behind the head.
        small = pool.submit(httpx.post, tight.base_url + CHAT, timeout=300,
                            json=chat_body("Say hi.", max_tokens=4))
        waiting = wait_for(tight, lambda m: m["butter_queued_requests"] == 2, "both queued")
        assert waiting["butter_active_requests"] == 1
        running.close()  # frees the reservation
        for future in (big, small):
            response = future.result(timeout=300)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert tight.wait_idle()["butter_kv_reserved_cells"] == 0
