"""The `butter` command: boot, bad flags, unknown models, plugins listing."""

import socket
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
    ("serve", "--model", "smollm2", "--bogus"),
    ("serve", "--model", "smollm2", "--cache-ram", "-1"),
    ("frobnicate",),
])
def test_bad_flags_exit_non_zero_with_one_line(args):
    result = butter(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("flag", "value"), [
    ("--max-context", "1"),
    ("--max-context", "2"),
    ("--max-context", "128"),
    ("--max-context", "300"),
    ("--max-context", "99999999"),  # 2.2 TB of KV; more than the model's trained 8192
    ("--parallel", "255"),
    ("--parallel", "100000"),
    ("--threads", "100000"),
    ("--ubatch-size", "100000"),
    ("--prefill-chunk", "100000"),
    ("--host", "no such host!"),
    ("--host", "203.0.113.7"),  # not an address of this machine
    ("--kv-cache", "bogus"),
    ("--kv-window-keep", "4"),
    ("--kv-cache", "aura9v1"),
    ("--aura-decode-path", "dequant-mirror"),
    ("--backend", "nope"),
    ("--models-dir", "/no/such/dir"),
    ("--allowed-origins", "not an origin"),
    ("--api-key", ""),
    ("--model", "/no/such/model.gguf"),
])
def test_a_flag_that_cannot_work_exits_2_naming_it_before_loading(flag, value):
    args = ["serve", "--model", "smollm2", flag, value]
    if flag == "--model":
        args = ["serve", flag, value]
    result = butter(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert flag in result.stderr and "Traceback" not in result.stderr
    assert "Loaded" not in result.stderr + result.stdout  # refused before loading


def test_a_port_in_use_is_refused_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = butter("serve", "--model", "smollm2", "--port", str(port))
    assert result.returncode == 2
    assert "--port" in result.stderr and "Loaded" not in result.stderr


def test_unknown_model_fails_at_boot_in_one_line():
    result = butter("serve", "--model", "/no/such/model.gguf")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "does not exist" in result.stderr


def test_max_context_is_the_context_admission_uses(start_server):
    import openai

    server = start_server("--max-context", "256")
    assert server.models()[0]["context_length"] == 256
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=120)
    long = " ".join(["word"] * 300)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", max_tokens=4,
                                       messages=[{"role": "user", "content": long}])
    assert info.value.code == "context_length_exceeded"
    fits = " ".join(["word"] * 200)
    reply = client.chat.completions.create(model="smollm2", max_tokens=8,
                                           messages=[{"role": "user", "content": fits}])
    assert reply.usage.prompt_tokens > 200 and reply.choices[0].finish_reason
    assert server.process.poll() is None


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

    card = server.models()[0]["butter"]
    assert card["kv_layout"] == "per-session" and card["micro_batch"] == 512
    shared = start_server("--kv-layout", "shared")
    card = shared.models()[0]["butter"]  # the batch-invariant default of a shared cache
    assert card["kv_layout"] == "shared" and card["micro_batch"] == 63
    shared.stop()
    fast = start_server("--kv-layout", "shared", "--ubatch-size", "512")
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


def test_each_back_end_lists_its_own_settings_and_refuses_another_ones():
    text = butter("serve", "--help").stdout
    assert "gguf back end:" in text and "--ubatch-size" in text and "--kv-layout" in text
    assert "mlx back end:" in text and "--prefill-step" in text
    result = butter("serve", "--model", "smollm2", "--prefill-step", "8")
    assert result.returncode == 2
    assert result.stderr.strip() == ("butter serve: error: --prefill-step: is a setting of "
                                     "the mlx back end; this model runs on gguf")
