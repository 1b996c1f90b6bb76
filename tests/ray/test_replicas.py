"""butter on Ray Serve: two replicas of SmolLM2, one thread each, behind one address.

One real ``butter serve --replicas 2`` (a local Ray cluster, Serve's proxy, the ingress and
two engine replicas) is shared by the whole module; the replica-killing test runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerProcess
from support.ray_server import RayServer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMOLLM2_CONTEXT = 8192
PARALLEL = 8
GAUGES = ("butter_cluster_active_requests", "butter_cluster_queued_requests",
          "butter_cluster_sessions_busy")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayServer]:
    # Eight sessions a replica: either could hold every tenant, so a tenant's later turn
    # is cached only when the router sent it where its prefix is.
    process = RayServer("--replicas", "2", "--threads", "1", "--parallel", str(PARALLEL),
                        timeout=240)
    deadline = time.monotonic() + 120
    while process.cluster().get("butter_cluster_replicas") != 2:  # both routable
        assert time.monotonic() < deadline, process.log_text()
        time.sleep(0.5)
    yield process
    process.stop()
    assert "Traceback" not in process.log_path.read_text(errors="replace")


def chat(server: RayServer, messages: list[dict], **fields) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": messages, "temperature": 0, **fields})


def wait_idle(server: RayServer, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.cluster()
        busy = [name for name in GAUGES if metrics.get(f'{name}{{replica="total"}}') != 0]
        inflight = {k: v for k, v in metrics.items() if k.startswith("butter_router_inflight")}
        if not busy and metrics.get("butter_cluster_replicas") == 2 and not any(
                inflight.values()):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas not idle: {busy} {metrics}")
        time.sleep(0.2)


# --- the surface -------------------------------------------------------------------------


def test_every_route_answers_through_the_proxy(cluster):
    assert httpx.get(f"{cluster.root}/health", timeout=10).text == "ok"
    models = httpx.get(f"{cluster.base_url}/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["smollm2"]
    assert models[0]["context_length"] == SMOLLM2_CONTEXT // PARALLEL  # per session
    assert models[0]["butter"]["replicas"] == 2
    assert models[0]["butter"]["threads"] == 1  # --threads reached every replica
    card = httpx.get(f"{cluster.base_url}/models/smollm2", timeout=10).json()
    assert card["id"] == "smollm2"
    counted = httpx.post(f"{cluster.root}/v1/messages/count_tokens", timeout=30, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hello there"}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 3
    text = httpx.post(f"{cluster.base_url}/completions", timeout=60, json={
        "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert text.status_code == 200 and text.json()["choices"][0]["text"]
    schema = httpx.get(f"{cluster.root}/schema/openapi.json", timeout=10).json()
    assert "/v1/chat/completions" in schema["paths"]


def test_openai_sdk_plain_and_streamed(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name the capital city of France."}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                           max_tokens=16)
    assert "Paris" in reply.choices[0].message.content
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=16, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert len(pieces) > 1  # token by token, not one lump
    assert "".join(pieces) == reply.choices[0].message.content
    assert usage.completion_tokens == reply.usage.completion_tokens
    two = client.chat.completions.create(model="smollm2", messages=messages, n=2,
                                         max_tokens=4, seed=7)
    assert len(two.choices) == 2


def test_anthropic_sdk_plain_and_streamed(cluster):
    import anthropic

    client = anthropic.Anthropic(base_url=cluster.root, api_key="x", max_retries=0,
                                 timeout=120)
    # The SDK no longer has a `temperature` argument.
    asked = {"model": "smollm2", "max_tokens": 16, "extra_body": {"temperature": 0},
             "system": "You answer in one short sentence.",
             "messages": [{"role": "user", "content": "Name the capital city of France."}]}
    message = client.messages.create(**asked)
    assert "Paris" in message.content[0].text
    with client.messages.stream(**asked) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens


# --- routing -----------------------------------------------------------------------------


def tenant_prompt(tenant: int) -> str:
    facts = " ".join(f"Rule {tenant}.{i}: the {['red', 'blue', 'green', 'gold'][i % 4]} "
                     f"ledger of house {tenant} opens on day {i * 7 + tenant}." for i in range(24))
    return f"You are the archivist of house {tenant}. {facts}"


def test_tenants_stay_on_the_replica_holding_their_prefix(cluster):
    wait_idle(cluster)
    before = cluster.cluster()
    replicas_before = cluster.replicas()
    tenants = range(8)
    histories = {t: [{"role": "system", "content": tenant_prompt(t)}] for t in tenants}

    async def ask(client: httpx.AsyncClient, tenant: int, turn: int) -> dict:
        histories[tenant].append({"role": "user", "content": f"Question {turn}: which day?"})
        answer = await client.post(f"{cluster.base_url}/chat/completions", json={
            "model": "smollm2", "messages": histories[tenant], "max_tokens": 6,
            "temperature": 0})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        histories[tenant].append({"role": "assistant",
                                  "content": body["choices"][0]["message"]["content"]})
        return body["usage"]

    async def rounds() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=300) as client:
            seen = []
            for turn in range(3):  # each round: every tenant at once
                seen.append(await asyncio.gather(*(ask(client, t, turn) for t in tenants)))
            return seen

    usages = asyncio.run(rounds())
    after = cluster.cluster()
    decided = {k: v - before.get(k, 0) for k, v in after.items()
               if k.startswith("butter_router_decisions_total")}
    # Every later turn was routed to the replica holding the tenant's prefix ... (Two CI
    # runs once saw 14-15 of 16: replicas reported their free KV against one session's
    # context, not the shared budget, so two active prompts read as a full replica and
    # its tenants were moved. Reproduced and fixed.) The replicas are named in the
    # message to tell a replaced replica (its prefix table forgotten) from a routing fault.
    facts = {"decided": decided, "replicas": (replicas_before, cluster.replicas())}
    assert decided['butter_router_decisions_total{kind="affinity"}'] >= 16, facts
    # ... and found it there: everything before this turn's question was in that
    # replica's KV. One miss in 16 is tolerated: Serve falls through to the next ranked
    # replica when the first does not answer its queue-length probe in time (a loaded
    # machine), and that replica reads the turn cold.
    misses = [(turn, tenant, usage) for turn, round_usages in enumerate(usages[1:], start=1)
              for tenant, usage in zip(tenants, round_usages)
              if usage["prompt_tokens_details"]["cached_tokens"] < 0.8 * usage["prompt_tokens"]]
    assert len(misses) <= 1, (misses, facts)
    served = {}
    for key, value in after.items():
        if key.startswith("butter_cluster_requests_total{") and 'replica="total"' not in key:
            served[key] = value - before.get(key, 0)
    assert len(served) == 2 and all(count >= 8 for count in served.values()), served
    rate = after['butter_cluster_prefix_hit_rate{replica="total"}']
    assert 0 < rate <= 1


# --- faults and load ---------------------------------------------------------------------


BAD_INPUTS = [
    ("POST", "/v1/chat/completions", b"{not json"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("POST", "/v1/chat/completions", {"messages": []}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": -1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "temperature": "hot"}),
    ("POST", "/v1/chat/completions", {"model": "no-such-model",
                                      "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 10 ** 6}),
    ("POST", "/v1/messages", {"model": "smollm2",
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages", {"model": "smollm2", "max_tokens": 5, "messages": "hi"}),
    ("POST", "/v1/messages/count_tokens", {"model": "smollm2"}),
    ("POST", "/v1/completions", {"prompt": [10 ** 9], "max_tokens": 2}),
    ("GET", "/v1/chat/completions", None),
    ("GET", "/v1/models/no-such-model", None),
    ("POST", "/v1/chat/completions", b"x" * (11 * 1024 * 1024)),
]


def answer_to(root: str, method: str, path: str, body) -> tuple[int, dict]:
    content = body if isinstance(body, bytes) else None
    payload = None if isinstance(body, bytes) or body is None else body
    response = httpx.request(method, f"{root}{path}", json=payload, content=content,
                             headers={"content-type": "application/json"}, timeout=60)
    try:
        parsed = response.json()
    except json.JSONDecodeError:
        parsed = {"text": response.text}
    return response.status_code, parsed


def test_bad_input_gets_the_same_4xx_as_one_process(cluster):
    one = ServerProcess("--no-swap", "--parallel", str(PARALLEL))  # same context a session
    try:
        for method, path, body in BAD_INPUTS:
            alone = answer_to(one.root, method, path, body)
            replicated = answer_to(cluster.root, method, path, body)
            assert 400 <= alone[0] < 500, (path, body if not isinstance(body, bytes) else
                                           body[:40], alone)
            assert replicated == alone, (method, path, alone, replicated)
        # The security edge is the same app: a foreign Host and a cross-site Origin.
        for headers in ({"Host": "evil.example"}, {"Origin": "https://evil.example"}):
            alone = httpx.get(f"{one.base_url}/models", headers=headers, timeout=10)
            replicated = httpx.get(f"{cluster.base_url}/models", headers=headers, timeout=10)
            assert replicated.status_code == alone.status_code == 403
    finally:
        one.stop()


def test_hang_up_storm_leaves_no_session_behind_on_any_replica(cluster):
    wait_idle(cluster)
    before = cluster.cluster()

    async def hang_up(client: httpx.AsyncClient, index: int) -> None:
        body = {"model": "smollm2", "stream": index % 3 != 0, "max_tokens": 200,
                "ignore_eos": True,
                "messages": [{"role": "system", "content": tenant_prompt(index % 4)},
                             {"role": "user", "content": f"Tell story {index}."}]}
        # Odd ones read the first bytes (the prompt was admitted), then hang up; even
        # ones give up after a fraction of a second, wherever their request then is.
        timeout = 120 if index % 2 else 0.3 + 0.2 * (index % 5)
        try:
            async with client.stream("POST", f"{cluster.base_url}/chat/completions",
                                     json=body, timeout=timeout) as response:
                async for _ in response.aiter_bytes():
                    if index % 2:
                        return  # gone after the first bytes
        except httpx.TimeoutException:
            return  # gone before (or while) the answer came

    async def storm() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(hang_up(client, i) for i in range(24)))

    asyncio.run(storm())
    after = wait_idle(cluster, timeout=90)
    cancelled = sum(v for k, v in after.items() if k.startswith("butter_cancellations_total"))
    cancelled_before = sum(v for k, v in before.items()
                           if k.startswith("butter_cancellations_total"))
    assert cancelled > cancelled_before  # the hang-ups reached the engines
    for key, value in after.items():
        if key.startswith(("butter_sessions_busy", "butter_active_requests",
                           "butter_kv_reserved_cells")):
            assert value == 0, (key, after)
    assert chat(cluster, [{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200


STREAMS = 8


def test_a_replica_killed_mid_stream(cluster):
    """Its streams end with an error event, the other replica's finish, Serve replaces it."""
    wait_idle(cluster)
    replicas = cluster.replicas()
    assert len(replicas) == 2

    async def stream(client: httpx.AsyncClient, index: int, started: asyncio.Event,
                     ready: list) -> list[str]:
        # The eight tenants of the routing test: their prefixes sit on both replicas.
        # Long enough that no stream ends before the last has started: a replica whose
        # streams read their prompts from cache once finished 120 tokens before the
        # other's cold ones began (CI, active 5 and 0 at the kill).
        body = {"model": "smollm2", "stream": True, "max_tokens": 480, "ignore_eos": True,
                "temperature": 0,
                "messages": [{"role": "system", "content": tenant_prompt(index)},
                             {"role": "user", "content": "Tell a long story."}]}
        events: list[str] = []
        async with client.stream("POST", f"{cluster.base_url}/chat/completions",
                                 json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        ready.append(index)
                        if len(ready) == STREAMS:
                            started.set()
        return events

    async def run() -> tuple[list, dict]:
        started, ready = asyncio.Event(), []
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, i, started, ready))
                     for i in range(STREAMS)]
            await asyncio.wait_for(started.wait(), 120)
            metrics = cluster.cluster()
            active = {r: metrics[f'butter_cluster_active_requests{{replica="{r}"}}']
                      for r in replicas}
            assert all(active.values()), active  # streams on both: one set must live on
            victim = max(active, key=active.get)
            os.kill(replicas[victim], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            return results, {"victim": victim, "active": active}

    results, facts = asyncio.run(run())
    errored = [events for events in results if any('"error"' in e for e in events)]
    finished = [events for events in results if not any('"error"' in e for e in events)]
    assert all(events[-1] == "[DONE]" for events in results)  # none hung
    assert len(errored) == facts["active"][facts["victim"]], facts
    assert finished, facts  # the other replica's streams were untouched
    for events in errored:
        error = json.loads(next(e for e in events if '"error"' in e))["error"]
        assert error["code"] == "replica_lost"
    for events in finished:
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length"
    # Serve starts a replacement; requests keep being served meanwhile.
    assert chat(cluster, [{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200
    deadline = time.monotonic() + 120
    while True:
        now = cluster.replicas()
        if len(now) == 2 and facts["victim"] not in now:
            break
        assert time.monotonic() < deadline, now
        time.sleep(1)
    wait_idle(cluster)
    for _ in range(4):
        assert chat(cluster, [{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200
