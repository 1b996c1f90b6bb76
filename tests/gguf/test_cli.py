"""The `butter` command: boot, bad flags, unknown models, plugins listing."""

import subprocess
import sys
import time

import pytest


def butter(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "butter", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args", [
    ("serve",),
    ("serve", "--model", "smollm2", "--port", "abc"),
    ("serve", "--model", "smollm2", "--parallel", "0"),
    ("serve", "--model", "smollm2", "--ubatch-size", "0"),
    ("serve", "--model", "smollm2", "--kv-window-keep", "4"),
    ("serve", "--model", "smollm2", "--bogus"),
    ("frobnicate",),
])
def test_bad_flags_exit_non_zero_with_one_line(args):
    result = butter(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_model_fails_at_boot_in_one_line():
    result = butter("serve", "--model", "/no/such/model.gguf")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "does not exist" in result.stderr


def test_boot_by_path_prints_routes_and_url(start_server, model_path):
    server = start_server(model=str(model_path))
    # /health can answer a moment before the banner reaches the log: poll for it.
    deadline = time.monotonic() + 30
    while server.base_url not in (log := server.log_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for route in ("/health", "/v1/models", "/v1/chat/completions", "/v1/messages", "/metrics"):
        assert route in log
    assert server.base_url in log


def test_ubatch_size_sets_the_native_micro_batch(start_server, server):
    import openai

    assert server.models()[0]["butter"]["micro_batch"] == 63  # the batch-invariant default
    fast = start_server("--ubatch-size", "512")
    assert fast.models()[0]["butter"]["micro_batch"] == 512
    client = openai.OpenAI(base_url=fast.base_url, api_key="-", max_retries=0, timeout=120)
    notes = " ".join(f"Note {n}: the archive opens at nine." for n in range(40))
    reply = client.chat.completions.create(  # ~400 prompt rows: one tiled micro-batch
        model="smollm2", temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": notes},
                  {"role": "user", "content": "When does the archive open?"}])
    assert reply.usage.prompt_tokens > 300
    assert reply.choices[0].message.content.strip()


def test_plugins_lists_what_loaded():
    result = butter("plugins")
    assert result.returncode == 0
    for name in ("gguf", "raw", "hermes", "qwen3_coder", "butter.resolvers"):
        assert name in result.stdout
