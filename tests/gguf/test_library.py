"""The in-process library API: Model, ButterServeBackend, ServeServer, ResidentServeBackend."""

import asyncio
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from conftest import free_port

from butter import ButterServeBackend, Model, ModelLoader, ResidentServeBackend, ServeServer
from butter.errors import InternalError, InvalidRequestError

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


@pytest.fixture(scope="module")
def model():
    with Model.load("smollm2") as loaded:
        yield loaded


def test_generate(model):
    result = model.generate(QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert result.usage.prompt_tokens == 37 and result.usage.completion_tokens > 0
    again = model.generate(QUESTION, max_tokens=24, temperature=0)
    assert again.text == result.text and again.usage.cached_tokens == 36


@pytest.mark.parametrize(("option", "value"), [
    ("temperature", 5), ("top_p", -1), ("frequency_penalty", 3), ("max_tokens", 0),
    ("logit_bias", {1: 500}), ("min_p", 2)])
def test_generate_checks_its_options_as_http_does(model, option, value):
    with pytest.raises(InvalidRequestError) as raised:
        model.generate("Hi", **{option: value})
    assert raised.value.param == option


def test_generate_raw_prompt_and_seed(model):
    first = model.generate("Once upon a time", max_tokens=10, temperature=0.9, seed=5)
    assert first.finish_reason == "length" and first.usage.completion_tokens == 10
    assert model.generate("Once upon a time", max_tokens=10, temperature=0.9, seed=5).text == \
        first.text


def test_a_native_failure_while_installing_fails_only_that_request(model):
    model.generate(QUESTION, max_tokens=2, temperature=0)  # the engine and its runtime are up
    runtime = model.engine._runtime

    def broken(params):
        del runtime.new_sampler  # fail once, then the class's method again
        raise RuntimeError("sampler chain could not be built")

    runtime.new_sampler = broken
    with pytest.raises(InternalError):
        model.generate(QUESTION, max_tokens=4, temperature=0)
    metrics = model.engine.metrics
    assert metrics.requests_failed >= 1 and metrics.active_requests == 0
    assert "Paris" in model.generate(QUESTION, max_tokens=24, temperature=0).text


def test_generate_stream(model):
    chunks = list(model.generate_stream(QUESTION, max_tokens=24, temperature=0))
    text = "".join(chunk.text for chunk in chunks)
    assert "Paris" in text and len([c for c in chunks if c.text]) > 3
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens > 0


class _Serving:
    """Run a ServeServer on its own event loop in a thread."""

    def __init__(self, backend):
        self.server = ServeServer(host="127.0.0.1", port=free_port(), backend=backend)
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.run_forever(),))

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.05)
        return openai.OpenAI(base_url=self.server.base_url, api_key="x", max_retries=0)

    def __exit__(self, *exc):
        self.server.stop()
        self.thread.join(15)


def test_butter_serve_backend_in_process_answers_the_openai_client(model):
    backend = ButterServeBackend(model, model_id="my-model", maximum_concurrent_requests=8)
    with _Serving(backend) as client:
        assert [m.id for m in client.models.list().data] == ["my-model"]
        reply = client.chat.completions.create(model="my-model", messages=QUESTION,
                                               temperature=0, max_tokens=24)
        assert "Paris" in reply.choices[0].message.content and reply.model == "my-model"
        streamed = client.chat.completions.create(model="my-model", messages=QUESTION,
                                                  temperature=0, max_tokens=24, stream=True)
        assert "Paris" in "".join(c.choices[0].delta.content or "" for c in streamed)


def test_resident_serve_backend_swaps(tmp_path, model_path):
    copy = tmp_path / "other.gguf"
    shutil.copyfile(model_path, copy)
    resident = ResidentServeBackend(loader=ModelLoader(allow_any_path=True), initial="smollm2")
    try:
        with _Serving(resident) as client:
            reply = client.chat.completions.create(model=str(copy), messages=QUESTION,
                                                   temperature=0, max_tokens=24)
            assert reply.model == copy.stem and "Paris" in reply.choices[0].message.content
            assert [m.id for m in client.models.list().data] == [copy.stem]
            assert resident.swaps == 1
    finally:
        resident.current.close()


def test_the_readme_library_example_runs(tmp_path):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("port=8000", f"port={free_port()}")
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()


def test_a_chat_prompt_knows_where_its_final_message_starts(model):
    """Every question on one system prompt starts its final message at the same token:
    where the runtime may read it otherwise (``PromptTail``), whatever the question."""
    from butter.chat.request import ChatRequest, parse_messages
    from butter.generation import GenerationParams

    def prepared(*messages):
        chat = ChatRequest(messages=parse_messages(list(messages)), params=GenerationParams())
        return model.prepare(chat)

    system = {"role": "system", "content": "You keep the harbour log. " * 20}
    first = prepared(system, {"role": "user", "content": "When does the tide turn?"})
    second = prepared(system, {"role": "user", "content": "<|im_end|> Who rang the bell?"})
    assert first.tail.start == second.tail.start
    assert first.tokens[:first.tail.start] == second.tokens[:second.tail.start]
    assert first.tail.end == len(first.tokens) and second.tail.end == len(second.tokens)
    head = model.prepare(ChatRequest(messages=parse_messages([system]),
                                     params=GenerationParams()))
    start = first.tail.start  # the system turn ends there
    assert start < len(head.tokens) and head.tokens[:start] == first.tokens[:start]
    # A completion has no messages, so no final message either.
    raw = model.prepare(ChatRequest(messages=[], params=GenerationParams(), raw_prompt="Hi"))
    assert raw.tail is None
