"""One resident model: request-driven swaps, failures that keep the old one, --no-swap."""

import concurrent.futures
import json
import shutil
import threading
import time

import httpx
import openai
import psutil
import pytest
from helpers import stream_lines

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


@pytest.fixture
def model_copy(tmp_path, model_path):
    copy = tmp_path / "copy-of-smollm2.gguf"
    shutil.copyfile(model_path, copy)
    return copy


def ask(client, model, **extra):
    return client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                          max_tokens=12, **extra)


def resident(server):
    return httpx.get(f"{server.base_url}/models").json()["data"][0]["id"]


def rss_mb(server) -> float:
    return psutil.Process(server.process.pid).memory_info().rss / 2**20


def test_swaps_back_and_forth_and_memory_returns_to_one_model(start_server, model_copy):
    server = start_server("--parallel", "2", "--allow-any-path")
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    first = ask(client, "smollm2").choices[0].message.content
    baseline = rss_mb(server)
    readings = []
    for _ in range(3):
        reply = ask(client, str(model_copy))
        # Named by its path, listed by its stem: /v1/models never shows a path.
        assert reply.model == model_copy.stem and resident(server) == model_copy.stem
        assert reply.choices[0].message.content == first
        assert reply.usage.prompt_tokens_details.cached_tokens == 0  # prefilled from scratch
        reply = ask(client, "smollm2")
        assert reply.model == "smollm2" and resident(server) == "smollm2"
        readings.append(rss_mb(server))
    # One model is ~98 MB of weights plus its KV; two resident would add at least that.
    assert max(readings) < baseline + 60, (baseline, readings)
    assert "swap requested: smollm2 -> " + str(model_copy) in server.log_text()


def test_the_resident_id_never_reloads(start_server, model_path):
    server = start_server()
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    ask(client, "smollm2")
    ask(client, "smollm2")
    ask(client, "smollm2-135m")  # another alias of the same checkpoint
    assert "swap requested" not in server.log_text()
    assert resident(server) == "smollm2"


def test_swap_aborts_streams_and_queued_requests_promptly(start_server, model_copy):
    server = start_server("--parallel", "1", "--allow-any-path")
    long_body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story."}],
                 "max_tokens": 1500, "ignore_eos": True, "stream": True}
    events: list[str] = []
    started = threading.Event()

    def queued():
        return httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": QUESTION, "max_tokens": 8})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streaming = pool.submit(stream_lines, server, long_body, events, started)
        assert started.wait(60)
        waiting = [pool.submit(queued) for _ in range(2)]
        deadline = time.monotonic() + 30
        while server.metrics()["butter_queued_requests"] < 2:
            assert time.monotonic() < deadline, "the two requests never queued"
            time.sleep(0.05)
        begun = time.monotonic()
        swapped = httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
            "model": str(model_copy), "messages": QUESTION, "max_tokens": 8, "temperature": 0})
        streaming.result(timeout=30)
        outcomes = [w.result(timeout=30) for w in waiting]
    assert time.monotonic() - begun < 30
    assert swapped.status_code == 200 and swapped.json()["model"] == model_copy.stem
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "request_aborted"
    for response in outcomes:
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "request_aborted"


def test_unknown_corrupt_and_empty_ids_keep_the_old_model(start_server, tmp_path, model_path):
    server = start_server("--models-dir", str(tmp_path))
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        ask(client, "no-such-model")
    assert info.value.code == "model_not_found"

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(model_path.read_bytes()[: 40_000_000])
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, str(truncated))
    assert info.value.code == "model_load_failed" and "truncated" in str(info.value)
    assert "Could not load" in str(info.value)
    reason = str(info.value).rsplit("`:", 1)[1]  # after the client's own id
    assert str(tmp_path) not in reason and not any(c.isdigit() for c in reason)

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all" * 100)
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, str(garbage))
    assert "not a GGUF file" in str(info.value)

    empty = tmp_path / "empty-model-dir"
    empty.mkdir()
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, str(empty))
    assert "no model weights" in str(info.value)

    assert resident(server) == "smollm2"
    assert "Paris" in ask(client, "smollm2").choices[0].message.content
    assert "swap done" not in server.log_text()


def test_no_swap_answers_404(start_server, model_copy):
    server = start_server("--no-swap")
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        ask(client, str(model_copy))
    assert info.value.code == "model_not_found"
    assert resident(server) == "smollm2"
    assert ask(client, "smollm2").choices[0].message.content
