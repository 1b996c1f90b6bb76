"""Helpers shared by the real-server tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import httpx
from conftest import ServerProcess

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "grey")


def reference_llama(path: Path, **settings):
    """llama-cpp-python's own ``Llama`` on ``path``, as a reference to compare with, on
    the model parameters butter loads with (on a CPU with AMX, no extra weight buffers:
    the pinned ggml's AMX matmul segfaults on multi-token batches of quantized weights)."""
    import llama_cpp

    from butter_backend_gguf.native import model_params

    with mock.patch.object(llama_cpp.llama_cpp, "llama_model_default_params", model_params):
        return llama_cpp.Llama(str(path), verbose=False, **settings)


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


async def answer(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                 max_tokens: int, sampling: dict) -> str:
    """One chat completion of exactly ``max_tokens`` tokens: its reasoning and its
    content, as ``reasoning|content``."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    response = await client.post(f"{url}/chat/completions", json=body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    return (message.get("reasoning_content") or "") + "|" + (message.get("content") or "")


async def alone_fused_again(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                            max_tokens: int, sampling: dict,
                            others: list[tuple[str, int, dict]]) -> tuple[str, str, str]:
    """``prompt``'s answer asked alone, then beside ``others`` ((prompt, max_tokens,
    sampling) each) at once, then alone again (SPEC 5: all three must be the same)."""
    alone = await answer(client, url, model, prompt, max_tokens, sampling)
    fused, *_ = await asyncio.gather(
        answer(client, url, model, prompt, max_tokens, sampling),
        *(answer(client, url, model, *other) for other in others))
    again = await answer(client, url, model, prompt, max_tokens, sampling)
    return alone, fused, again
