"""KV codecs and windows on the GGUF back end, through real servers and the library.

Codecs map to llama.cpp cache types (logged once), a quantized cache stretches the same
byte budget over more cells, and a window lets an answer run past it by llama.cpp's
context shift, unchanged until the first shift and never reused once shifted.
"""

import os
import subprocess
import sys
import textwrap

import openai
import pytest

from butter.backend import KVSpec
from butter.library import Model, default_plugins

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who bakes bread."}]
# SmolLM2: 30 layers x 3 KV heads x 64 dims, keys and values, float16.
RAW_TOKEN_BYTES = 30 * 3 * 64 * 2 * 2


def butter(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "butter", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args", [
    ("--kv-cache", "aura9v1"),
    ("--kv-cache", "aura0v4"),
    ("--kv-cache", "auraXvY"),
    ("--kv-cache", "affine8", "--aura-decode-path", "compressed"),  # not an AURA codec
    ("--kv-cache", "aura", "--aura-decode-path", "dequant-mirror"),  # llama.cpp has none
    ("--kv-window-size", "99999"),  # more than the trained 8192
    ("--kv-window-size", "600", "--max-context", "1024", "--parallel", "2"),  # 512 each
    ("--kv-window-size", "256", "--kv-window-keep", "256"),
])
def test_a_codec_or_window_that_cannot_work_exits_2_before_loading(args):
    result = butter("serve", "--model", "smollm2", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "Traceback" not in result.stderr and "Loaded" not in result.stderr
    flags = [arg for arg in args if arg.startswith("--")]
    assert any(flag in result.stderr for flag in flags)


def test_plugins_lists_each_codec_with_bits_and_storage():
    result = butter("plugins", env={**os.environ, "COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    lines = {line.split("│")[2].strip(): line for line in result.stdout.splitlines()
             if line.count("│") >= 3 and "kv-codec" in line}
    assert {"raw", "affine8", "affine4", "aura", "auraNvM"} <= set(lines)
    assert "8.5 bits/element" in lines["affine8"] and "gguf: keys q8_0, values q8_0" \
        in lines["affine8"]
    assert "gguf: keys q4_0, values q4_0" in lines["affine4"]


@pytest.mark.parametrize(("codec", "types", "token_bytes"), [
    ("affine8", "keys q8_0, values q8_0", 30 * 192 * 17 // 8),
    ("aura8v4", "keys q8_0, values q4_0", 30 * 192 * 13 // 8),
])
def test_a_codec_is_served_as_llama_cpp_cache_types_in_the_same_budget(start_server, codec,
                                                                       types, token_bytes):
    server = start_server("--kv-cache", codec, "--parallel", "2", "--max-context", "2048")
    card = server.models()[0]
    assert card["butter"]["kv_cache"] == codec and card["butter"]["kv_cache_types"] == types
    # The bytes of 1024 raw cells per session hold more cells once quantized.
    cells = 1024 * RAW_TOKEN_BYTES // token_bytes // 256 * 256
    assert card["context_length"] == cells > 1024
    metrics = server.metrics()
    assert metrics["butter_kv_token_bytes"] == token_bytes
    assert metrics["butter_kv_budget_bytes"] == 2 * cells * token_bytes
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content
    log = " ".join(server.log_text().split())  # rich wraps long lines
    assert log.count(f"KV codec {codec} as llama.cpp cache types: {types}") == 1
    if codec.startswith("aura"):
        assert "4-bit values" not in log and "own Hadamard rotation" in log
    server.stop()


def test_a_codec_llama_cpp_has_no_equivalent_for_is_served_raw(tmp_path, start_server):
    """A third-party codec from a test distribution's entry point: found by name, listed,
    and served raw on GGUF with a log line saying so."""
    (tmp_path / "tiny_codec.py").write_text(textwrap.dedent('''
        from butter.hookspecs import hookimpl
        from butter.kvcodec import KVCodec

        @hookimpl
        def register_kv_codecs(register):
            register("lattice3", KVCodec(name="lattice3", family="lattice", key_bits=3,
                                         value_bits=3, group_size=32))
    '''))
    dist = tmp_path / "tiny_codec-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-codec\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[butter]\ntiny = tiny_codec\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "250"}
    listing = butter("plugins", env=env)
    assert "lattice3" in listing.stdout and "gguf: served raw" in listing.stdout
    os.environ["PYTHONPATH"] = str(tmp_path)  # the server process inherits it
    try:
        server = start_server("--kv-cache", "lattice3")
    finally:
        del os.environ["PYTHONPATH"]
    assert server.models()[0]["butter"]["kv_cache_types"] == "keys f16, values f16"
    log = " ".join(server.log_text().split())
    assert "no equivalent of the lattice family; serving the cache raw" in log
    server.stop()


def _letters(text: str) -> float:
    return sum(c.isalpha() or c.isspace() or c in ".,;:'!?\"-" for c in text) / max(len(text), 1)


@pytest.mark.slow  # a 600-token answer (312 s of a loaded -m "not slow" run)
def test_an_answer_runs_past_the_window_and_a_shifted_session_is_not_reused(start_server):
    server = start_server("--kv-window-size", "256", "--parallel", "2", "--max-context", "1024")
    assert server.models()[0]["context_length"] == 256  # the prompt must fit the window
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=300)
    long = client.chat.completions.create(model="smollm2", messages=STORY, max_tokens=600,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 600 and long.choices[0].finish_reason == "length"
    tail = long.choices[0].message.content[-1500:]  # written after two shifts
    words = tail.split()  # still English words (greedy SmolLM2 may loop on a phrase)
    assert _letters(tail) > 0.9 and len(set(words)) >= 8, tail
    assert 2.5 < sum(map(len, words)) / len(words) < 8, tail
    # Following up on a shifted conversation prefills it afresh (its cache lost the middle).
    history = STORY + [{"role": "assistant", "content": long.choices[0].message.content[:200]},
                       {"role": "user", "content": "Thanks."}]
    again = client.chat.completions.create(model="smollm2", messages=history, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    # One that never shifted is reused as usual.
    short = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                           temperature=0)
    follow = QUESTION + [{"role": "assistant", "content": short.choices[0].message.content},
                         {"role": "user", "content": "And of Spain?"}]
    reused = client.chat.completions.create(model="smollm2", messages=follow, max_tokens=4)
    assert reused.usage.prompt_tokens_details.cached_tokens > 10
    with pytest.raises(openai.BadRequestError) as info:  # a prompt longer than the window
        client.chat.completions.create(model="smollm2", max_tokens=4, messages=[
            {"role": "user", "content": " ".join(["word"] * 300)}])
    assert info.value.code == "context_length_exceeded"
    server.stop()


def test_a_window_changes_nothing_before_its_first_shift():
    plugins = default_plugins()
    with Model.load("smollm2", backend="gguf") as model:
        model.start_engine(model.engine_config(capacity=1024))
        plain = model.generate(STORY, max_tokens=150, temperature=0, ignore_eos=True)
        model.start_engine(model.engine_config(capacity=1024, kv=KVSpec(
            codec=plugins.kv_codec("raw"), window=256, keep=4)))
        windowed = model.generate(STORY, max_tokens=150, temperature=0, ignore_eos=True)
    assert plain.usage.prompt_tokens + 150 < 256  # no shift happened
    assert windowed.text == plain.text
