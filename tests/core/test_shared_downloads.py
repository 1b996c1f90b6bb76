"""Request-driven downloads: one per id, shared by the requests naming it (no network)."""

from __future__ import annotations

import asyncio
import threading

from butter.errors import ModelDownloadError
from butter.hub import SharedDownloads, parse_hub_id


async def test_requests_for_one_id_share_one_download_and_a_failure_is_retried():
    release = threading.Event()
    calls: list[str] = []

    def fetch(hub_id):
        calls.append(hub_id.text)
        if not release.wait(10):
            raise AssertionError("never released")
        if len(calls) == 1:
            raise ModelDownloadError(hub_id.text, "cannot reach the hub")
        return hub_id.text

    downloads = SharedDownloads(fetch)
    hub_id = parse_hub_id("lab/model:Q4_0")
    first = [asyncio.ensure_future(downloads.fetch(hub_id)) for _ in range(3)]
    await asyncio.sleep(0.05)
    first[0].cancel()  # a client that goes away does not cancel the others' download
    release.set()
    results = await asyncio.gather(*first[1:], return_exceptions=True)
    assert calls == ["lab/model:Q4_0"]
    assert all(isinstance(r, ModelDownloadError) for r in results)
    assert await downloads.fetch(hub_id) == "lab/model:Q4_0"  # the failure was forgotten
    assert len(calls) == 2 and downloads.started == 2


async def test_the_event_loop_runs_while_a_download_does():
    release = threading.Event()
    downloads = SharedDownloads(lambda hub_id: release.wait(10) and hub_id.text)
    pending = asyncio.ensure_future(downloads.fetch(parse_hub_id("lab/a")))
    ticks = 0
    for _ in range(5):  # the loop keeps serving while the worker thread downloads
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and not pending.done()
    release.set()
    assert await pending == "lab/a"
