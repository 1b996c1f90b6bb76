"""Replicas load hub ids too (issue 23 after the seed-model issue): ``butter serve
--replicas 1 --model lab/smollm2-gguf`` against the loopback hub downloads the GGUF once
and the replica serves it through Serve's proxy."""

from __future__ import annotations

import httpx
import pytest
from support.hubtest import GGUF_FILE, GGUF_REPO
from support.ray_server import RayServer

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (butter-core[ray])")


def test_a_replica_serves_a_model_named_by_its_hub_id(hub, hf_env):
    server = RayServer("--replicas", "1", "--threads", "1", model=GGUF_REPO, timeout=240)
    try:
        models = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [GGUF_REPO]
        answer = httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
            "model": GGUF_REPO, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name the capital city of France."}]})
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
        assert hub.gets(GGUF_REPO, GGUF_FILE)  # from the loopback hub, not a copy
    finally:
        server.stop()
