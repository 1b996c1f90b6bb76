"""The prompt cache in host memory (`--cache-ram`) on the real model.

One session (`--parallel 1`): a second, unrelated prompt takes the session that held the
first, so asking the first again would read its whole prompt. With the cache the session's
keys and values went to host memory first, and the repeat loads them back: the client sees
`cached_tokens` cover the prompt and the same answer, greedy or seeded.

Under the server, the runtime: a load beside a fork whose copy llama.cpp has not made yet.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import notes
from support.chunked_read import read_from


@pytest.fixture(scope="module")
def one_session():
    from conftest import ServerProcess

    process = ServerProcess("--parallel", "1")
    yield process
    process.stop()


def ask(client, system: str, question: str, **fields):
    return client.chat.completions.create(
        max_tokens=24,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        **{"model": "smollm2", "temperature": 0, **fields})


def cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def client_of(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=120)


def test_a_displaced_prompt_loads_back_from_host_memory(one_session):
    client = client_of(one_session)
    librarian = "You are a meticulous librarian. " + notes(30, "shelves")
    first = ask(client, librarian, "Which lamp stays on?")
    assert cached(first) < 10
    before = one_session.metrics()
    other = ask(client, "You answer in one word. " + notes(30, "rivers"), "Name a river.")
    assert cached(other) < 10  # it shares only the template's first tokens
    again = ask(client, librarian, "Which lamp stays on?")
    # Everything but the last prompt token (read to draw the first answer token) loads back.
    assert cached(again) == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    after = one_session.metrics()
    assert after["butter_prompt_cache_saves_total"] - before["butter_prompt_cache_saves_total"] >= 1
    assert after["butter_prompt_cache_hits_total"] - before["butter_prompt_cache_hits_total"] == 1
    assert after["butter_prompt_cache_tokens_total"] \
        - before["butter_prompt_cache_tokens_total"] == cached(again)
    assert after["butter_prompt_cache_bytes"] > 0 and after["butter_prompt_cache_entries"] >= 1
    assert one_session.models()[0]["butter"]["prompt_cache_mib"] == 8192


@pytest.fixture(scope="module")
def one_uncached_session():
    from conftest import ServerProcess

    process = ServerProcess("--parallel", "1", "--cache-ram", "0")
    yield process
    process.stop()


@pytest.mark.parametrize("fields", [{}, {"temperature": 0.9, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_new_question_answers_as_it_would_on_a_fresh_read(one_uncached_session, fields):
    """A short question after a system prompt that another request read (there with a
    long question, whose first tokens it shares) reads only itself, and answers what it
    answered read whole (SPEC 5), to the last bit of every log-probability: the runtime
    keeps only the system prompt, not the question's opening read the long question's
    way."""
    client = client_of(one_uncached_session)
    fields = {**fields, "logprobs": True, "top_logprobs": 3}
    seed = fields.get("seed", 0)
    keeper = f"You keep a lighthouse ({seed}). " + notes(30, "lamps")
    question = "Which lamp is brightest?"
    fresh = ask(client, keeper, question, **fields)
    assert cached(fresh) < 10
    ask(client, "You answer in one word. " + notes(30, f"rivers {seed}"), "Name a river.")
    long = ask(client, keeper, "Which of the notes about the lamps mentions the lens, the "
               "wick, the oil, the glass, the clockwork, the shutters, the stairs or the "
               "gallery rail, and how many times each? Answer in a table, one row a word, "
               "with the count in the second column.")  # over 40 tokens
    assert cached(long) < 10
    again = ask(client, keeper, question, **fields)
    prompt = again.usage.prompt_tokens
    assert prompt - 16 <= cached(again) < prompt - 1  # the system prompt, not the question
    assert again.choices[0].message.content == fresh.choices[0].message.content
    assert again.choices[0].logprobs == fresh.choices[0].logprobs


def test_a_new_question_on_a_saved_system_prompt_reads_only_the_question(one_session):
    client = client_of(one_session)
    guide = "You are a guide to glaciers. " + notes(30, "ice")
    ask(client, guide, "Name one glacier.")
    ask(client, "You answer in one word. " + notes(30, "deserts"), "Name a desert.")
    seeded = {"temperature": 0.9, "seed": 7}
    follow = ask(client, guide, "How old is the ice?", **seeded)
    prompt = follow.usage.prompt_tokens
    assert prompt - 16 <= cached(follow) < prompt  # the system prompt came back; not the rest
    # Displaced and loaded back once more, the seeded question draws the same answer.
    ask(client, "You answer in one word. " + notes(30, "forests"), "Name a tree.")
    again = ask(client, guide, "How old is the ice?", **seeded)
    assert again.choices[0].message.content == follow.choices[0].message.content


def test_without_the_cache_a_displaced_prompt_is_read_again(start_server, one_session):
    server = start_server("--parallel", "1", "--cache-ram", "0")
    client = client_of(server)
    archivist = "You are a patient archivist. " + notes(30, "boxes")
    first = ask(client, archivist, "Which lamp stays on?")
    ask(client, "You answer in one word. " + notes(30, "hills"), "Name a hill.")
    again = ask(client, archivist, "Which lamp stays on?")
    assert cached(again) < 10
    metrics = server.metrics()
    assert metrics["butter_prompt_cache_hits_total"] == 0
    assert metrics["butter_prompt_cache_bytes"] == 0
    assert server.models()[0]["butter"]["prompt_cache_mib"] == 0
    # And the cache changes no answer: the server with it gives this one too.
    cached_side = ask(client_of(one_session), archivist, "Which lamp stays on?")
    assert cached_side.choices[0].message.content == first.choices[0].message.content \
        == again.choices[0].message.content


@pytest.mark.parametrize("args", [
    ("--kv-layout", "shared", "--cache-ram", "64"),
    ("--kv-window-size", "512", "--cache-ram", "64"),
])
def test_a_cache_ram_that_cannot_be_kept_exits_2_naming_it(args):
    result = subprocess.run([sys.executable, "-m", "butter", "serve", "--model", "smollm2",
                             *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--cache-ram" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr


@pytest.fixture(scope="module")
def streams():
    """The real model on two per-session streams, as ``butter serve`` keeps them."""
    from butter.backend import KVSpec
    from butter.library import default_plugins

    plugins = default_plugins()
    model = plugins.backends["gguf"].load(plugins.resolve("smollm2"), threads=2)
    runtime = model.create_runtime(kv=KVSpec(codec=plugins.kv_codec("raw")), capacity=2048,
                                   n_sessions=2, max_batch=512,
                                   options={"kv_layout": "per-session"})
    yield model, runtime
    runtime.close()
    model.close()


@pytest.mark.parametrize("into", ["target", "source"])
def test_a_load_beside_a_fork_not_yet_copied_reads_as_a_fresh_read(streams, into):
    """A fork between streams copies the bytes at the next decode (llama.cpp's stream
    copy): a load into the fork's target before then would be overwritten by the copy,
    one into its source copied into the target. Either way, what each session then
    draws is what a fresh read of its own prompt draws (the CI run of stop 35 answered a
    harbour prompt with the quay notes another request was reading)."""
    from butter.backend import Work

    model, runtime = streams
    harbour = model.tokenize(notes(20, "the harbour"), add_special=False, parse_special=False)
    quay = model.tokenize(notes(20, "the quay"), add_special=False, parse_special=False)
    fresh = {}
    for name, tokens in (("harbour", harbour), ("quay", quay)):
        runtime.truncate(0, 0)
        fresh[name] = read_from(runtime, 0, tokens, [], 0)
    runtime.truncate(0, 0)
    runtime.step([Work(0, harbour[:-20], None)])
    saved = runtime.save(0, len(harbour) - 20)
    assert saved is not None
    runtime.truncate(0, 0)
    runtime.truncate(1, 0)
    runtime.step([Work(1, quay, None)])
    forked = len(quay) - 10
    assert runtime.fork(1, 0, forked)
    loads, keeps = (0, 1) if into == "target" else (1, 0)
    loaded = runtime.restore(loads, saved, len(harbour) - 20)
    start = len(harbour) - 20 if loaded else 0
    assert read_from(runtime, loads, harbour, [], start) == fresh["harbour"]
    if keeps == 0:  # the fork's target reads on from what it was given
        assert read_from(runtime, 0, quay, [], forked) == fresh["quay"]


def test_a_hybrid_models_displaced_prompt_loads_back_from_its_snapshots(start_server,
                                                                        tiny_qwen35_gguf):
    """Qwen3.5's recurrent state cannot be cut back: a saved cache keeps the session's
    state snapshots beside its bytes, and a load is cut at the last one inside the shared
    prefix (the tail snapshot for the same prompt, a multiple of 32 for a new question);
    the answers are what a fresh read gives (the server without the cache)."""
    cached_side = start_server("--parallel", "1", model=str(tiny_qwen35_gguf))
    fresh_side = start_server("--parallel", "1", "--cache-ram", "0",
                              model=str(tiny_qwen35_gguf))
    model = cached_side.models()[0]["id"]
    assert cached_side.models()[0]["butter"]["prompt_cache_mib"] == 8192
    client, fresh = client_of(cached_side), client_of(fresh_side)
    guide = "You are a guide to glaciers. " + notes(12, "ice")
    seeded = {"temperature": 0.9, "seed": 11, "model": model}
    first = ask(client, guide, "Name one glacier.", **seeded)
    ask(client, "You answer in one word. " + notes(12, "deserts"), "Name a desert.", **seeded)
    again = ask(client, guide, "Name one glacier.", **seeded)
    prompt = again.usage.prompt_tokens
    assert prompt - 6 <= cached(again) <= prompt - 4  # the tail snapshot's bytes came back
    assert again.choices[0].message.content == first.choices[0].message.content
    ask(client, "You answer in one word. " + notes(12, "rivers"), "Name a river.", **seeded)
    other = ask(client, guide, "How old is the ice?", **seeded)
    assert cached(other) >= 32 and cached(other) % 32 == 0  # cut at a snapshot
    assert other.choices[0].message.content \
        == ask(fresh, guide, "How old is the ice?", **seeded).choices[0].message.content
    metrics = cached_side.metrics()
    assert metrics["butter_prompt_cache_hits_total"] == 2
