"""The `butter` command: boot, bad flags, unknown models, plugins listing."""

import subprocess
import sys

import pytest


def butter(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "butter", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args", [
    ("serve",),
    ("serve", "--model", "smollm2", "--port", "abc"),
    ("serve", "--model", "smollm2", "--parallel", "0"),
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
    log = server.log_text()
    for route in ("/health", "/v1/models", "/v1/chat/completions", "/v1/messages", "/metrics"):
        assert route in log
    assert server.base_url in log


def test_plugins_lists_what_loaded():
    result = butter("plugins")
    assert result.returncode == 0
    for name in ("gguf", "raw", "hermes", "qwen3_coder", "butter.resolvers"):
        assert name in result.stdout
