"""Several models behind one address: one Ray Serve deployment per model.

One real ``butter serve --replicas 1 --threads 1 --model smollm2 --model <tiny Qwen3.5>``
(two deployments of one replica each: the machine's two cores) is shared by the module.
Each answer must come from its own model's deployment: the answer's ``model``, the
per-model counters in ``/metrics`` and the two tokenizers' different counts show it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.ray_server import RayServer, metrics_by_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMOLLM2 = "smollm2"
QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


@pytest.fixture(scope="module")
def qwen_id(tiny_qwen35_gguf: Path) -> str:
    return tiny_qwen35_gguf.stem  # a path is served under its file name


@pytest.fixture(scope="module")
def models(tiny_qwen35_gguf: Path, qwen_id: str) -> Iterator[RayServer]:
    process = RayServer("--model", str(tiny_qwen35_gguf), "--replicas", "1", "--threads",
                        "1", "--parallel", "2", timeout=240)
    deadline = time.monotonic() + 120
    while True:  # both deployments routable
        counted = metrics_by_model(process.root)
        if all(counted.get(("butter_cluster_replicas", m, "")) == 1
               for m in (SMOLLM2, qwen_id)):
            break
        assert time.monotonic() < deadline, process.log_text()
        time.sleep(0.5)
    yield process
    process.stop()
    assert "Traceback" not in process.log_path.read_text(errors="replace")


def served(counted: dict, model: str) -> float:
    return counted[("butter_cluster_requests_total", model, "total")]


def test_every_model_is_listed_and_answers_from_its_own_deployment(models, qwen_id):
    import openai

    client = openai.OpenAI(base_url=models.base_url, api_key="x", max_retries=0, timeout=120)
    listed = client.models.list().data
    assert [m.id for m in listed] == [SMOLLM2, qwen_id]  # the order given, first the default
    assert all(m.model_extra["butter"]["replicas"] == 1 for m in listed)
    assert client.models.retrieve(qwen_id).id == qwen_id
    assert httpx.get(f"{models.root}/health", timeout=10).text == "ok"
    before = metrics_by_model(models.root)

    reply = client.chat.completions.create(model=SMOLLM2, messages=QUESTION, temperature=0,
                                           max_tokens=16)
    assert reply.model == SMOLLM2 and "Paris" in reply.choices[0].message.content
    other = client.chat.completions.create(model=qwen_id, messages=QUESTION, temperature=0,
                                           max_tokens=4)
    assert other.model == qwen_id and other.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=qwen_id, messages=QUESTION,
                                                 max_tokens=4, stream=True))
    assert chunks and {chunk.model for chunk in chunks} == {qwen_id}
    # Two tokenizers: the same words count differently on each model's deployment.
    counts = {model: httpx.post(f"{models.root}/v1/messages/count_tokens", timeout=30, json={
        "model": model, "messages": QUESTION}).json()["input_tokens"]
        for model in (SMOLLM2, qwen_id)}
    assert counts[SMOLLM2] != counts[qwen_id], counts
    assert counts[SMOLLM2] == reply.usage.prompt_tokens

    after = metrics_by_model(models.root)
    assert served(after, SMOLLM2) - served(before, SMOLLM2) == 1
    assert served(after, qwen_id) - served(before, qwen_id) == 2
    replicas = {model: {replica for (name, m, replica) in after
                        if name == "butter_cluster_replica_pid" and m == model}
                for model in (SMOLLM2, qwen_id)}
    assert all(len(ids) == 1 for ids in replicas.values()), replicas
    assert replicas[SMOLLM2] != replicas[qwen_id]  # a replica of each, labelled per model
    (smol_replica,) = replicas[SMOLLM2]
    assert after[("butter_requests_total", SMOLLM2, smol_replica)] == served(after, SMOLLM2)


def test_a_request_naming_no_model_goes_to_the_first(models):
    """As on one process, where a request naming no model gets the resident one."""
    answer = httpx.post(f"{models.base_url}/chat/completions", timeout=120, json={
        "messages": QUESTION, "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["model"] == SMOLLM2


def test_a_model_not_served_is_404_with_the_openai_and_anthropic_bodies(models):
    import anthropic
    import openai

    client = openai.OpenAI(base_url=models.base_url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=2)
    assert raised.value.body == {
        "message": "The model `no-such-model` does not exist or is not available here.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    claude = anthropic.Anthropic(base_url=models.root, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=QUESTION)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "not_found_error"


def test_the_anthropic_sdk_reaches_the_second_model(models, qwen_id):
    import anthropic

    client = anthropic.Anthropic(base_url=models.root, api_key="x", max_retries=0,
                                 timeout=120)
    asked = {"model": qwen_id, "max_tokens": 4, "messages": QUESTION,
             "extra_body": {"temperature": 0}}
    message = client.messages.create(**asked)
    assert message.model == qwen_id and message.usage.output_tokens == 4
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert final.model == qwen_id and final.usage.output_tokens == 4
