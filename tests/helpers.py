"""Helpers shared by the real-server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
from conftest import ServerProcess

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "grey")


def notes(count: int, topic: str) -> str:
    """Filler text of roughly ``10 * count`` tokens."""
    return " ".join(f"Note {i} on {topic}: the {COLOURS[i % 7]} lamp stays on."
                    for i in range(count))


def wait_for(server: ServerProcess, condition: Callable[[dict], bool], what: str,
             timeout: float = 60) -> dict:
    """Poll ``/metrics`` until ``condition`` holds; fail with the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if condition(metrics):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {metrics}")
        time.sleep(0.05)


def stream_lines(server: ServerProcess, body: dict, lines: list[str],
                 started: threading.Event | None = None) -> None:
    """POST a streamed chat completion and append each non-empty SSE line to ``lines``
    as it arrives; ``started`` is set once more than three have come."""
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body,
                      timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
                if started is not None and len(lines) > 3:
                    started.set()
