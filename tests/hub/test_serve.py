"""``butter serve`` with hub ids: at start, and pulled by requests with --allow-downloads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from support.hubtest import GGUF_FILE, GGUF_REPO

HUB_ID = f"{GGUF_REPO}:Q4_1"
ASK = [{"role": "user", "content": "Name the capital city of France."}]


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def test_serve_downloads_a_hub_id_then_serves_it_offline(hub, hf_env, start_server,
                                                         monkeypatch):
    server = start_server(model=HUB_ID)
    assert "98.4/98.4 MB" in server.log_text()  # the download's progress, before loading
    reply = client_for(server).chat.completions.create(model=HUB_ID, messages=ASK,
                                                       max_tokens=8, temperature=0)
    assert reply.model == HUB_ID and reply.choices[0].message.content
    assert [m["id"] for m in server.models()] == [HUB_ID]
    server.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = start_server(model=HUB_ID)
    reply = client_for(again).chat.completions.create(model=HUB_ID, messages=ASK,
                                                      max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    assert len(hub.gets(GGUF_REPO, GGUF_FILE)) == 1


def test_a_request_for_a_hub_id_not_cached_is_404_without_allow_downloads(hub, hf_env,
                                                                         start_server):
    server = start_server()
    try:
        client_for(server).chat.completions.create(model=HUB_ID, messages=ASK, max_tokens=4)
    except openai.NotFoundError as error:
        assert error.body["code"] == "model_not_found"
    else:
        raise AssertionError("a hub id that is not cached was served")
    assert hub.log == []  # nothing asked the hub


def test_requests_pull_a_hub_id_while_the_resident_model_keeps_streaming(hub, hf_env,
                                                                        start_server):
    # One thread: ggml's two-thread pool stalls at every barrier on a busy two-core machine.
    server = start_server("--allow-downloads", "--parallel", "2", "--threads", "1")
    client = client_for(server)
    hub.rate = 15e6  # about 6.5 s for the 98 MB file
    stamps: list[float] = []
    ended: list[BaseException | None] = []

    def stream() -> None:
        try:
            for chunk in client.chat.completions.create(
                    model="smollm2", messages=ASK, max_tokens=3000, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.monotonic())
            ended.append(None)
        except openai.APIError as error:  # the swap ends the old model's requests
            ended.append(error)

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 60
    while len(stamps) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(stamps) >= 5, server.log_text()

    def ask(_):
        return client.chat.completions.create(model=HUB_ID, messages=ASK, max_tokens=8,
                                              temperature=0)

    with ThreadPoolExecutor(2) as pool:  # two requests for one id: one download
        replies = list(pool.map(ask, range(2)))
    streaming.join(120)
    assert [r.model for r in replies] == [HUB_ID, HUB_ID]
    log = server.log_text()  # the operator sees the download in the log
    assert f"downloading {HUB_ID}: 1 files, 98.4 MB" in log and f"downloaded {HUB_ID}" in log
    assert all(r.choices[0].message.content for r in replies)
    gets = hub.gets(GGUF_REPO, GGUF_FILE)
    assert len(gets) == 1, gets
    listings = [e for e in hub.log if e.repo == GGUF_REPO and e.path == "api/tree"]
    assert len(listings) == 1  # one download ran, not two sharing the cache's file lock
    began, done = gets[0].at, gets[0].ended
    assert done - began > 4
    # The stream ran through the whole download: tokens all along, no gap near the
    # download's length (the machine is shared, so a second's gap alone proves nothing).
    during = [s for s in stamps if began <= s <= done]
    gaps = [b - a for a, b in zip([began, *during], [*during, done])]
    assert len(during) >= 10 and max(gaps) < (done - began) / 3, (len(during), gaps)
    assert ended and [m["id"] for m in server.models()] == [HUB_ID]
    try:  # a repository the hub does not have is 404, as any unknown id
        client.chat.completions.create(model="lab/missing", messages=ASK, max_tokens=4)
    except openai.NotFoundError as error:
        assert error.body["code"] == "model_not_found" and "lab/missing" in error.message
    else:
        raise AssertionError("an unknown repository was served")
    assert [m["id"] for m in server.models()] == [HUB_ID]
