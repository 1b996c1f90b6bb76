"""A Hugging Face hub on loopback for the hub tests (``support.fakehub``).

``hub_repos`` is the one place repositories are declared: repo id -> {path: bytes or a
file}. Add a repository there (or ``hub.add(...)`` from a fixture of your own, as
``mlx_repo`` does) and every test can name it; ``hf_env`` points ``HF_ENDPOINT`` at the
hub and ``HF_HOME`` at a fresh folder, so each test starts with an empty cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fakehub import FakeHub
from support.hubtest import GATED_REPO, GATED_TOKEN, GGUF_FILE, GGUF_REPO, MLX_REPO


def _fake_gguf(name: str) -> bytes:
    return b"GGUF" + name.encode()  # never loaded: the choice of file is what is tested


@pytest.fixture(scope="session")
def hub_repos(model_path: Path) -> dict[str, dict[str, bytes | Path]]:
    """Every repository the loopback hub serves (repo id -> files)."""
    return {
        GGUF_REPO: {GGUF_FILE: model_path, "README.md": b"# SmolLM2 135M, Q4_1\n"},
        "lab/many-ggufs": {name: _fake_gguf(name) for name in (
            "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q4_1.gguf", "m-instruct-Q4_1.gguf",
            "mmproj-m-Q8_0.gguf")},
        "lab/no-weights": {"README.md": b"weights elsewhere\n", "pytorch_model.bin": b"pt"},
    }


@pytest.fixture(scope="session")
def hub(hub_repos) -> Iterator[FakeHub]:
    server = FakeHub(hub_repos)
    server.add(GATED_REPO, hub_repos[GGUF_REPO], gated_token=GATED_TOKEN)
    yield server
    server.close()


@pytest.fixture
def hf_env(hub: FakeHub, tmp_path: Path, monkeypatch) -> dict[str, str]:
    """The environment of a fresh machine that talks to the loopback hub: also set in
    this process, so servers started by the test inherit it."""
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hub.log.clear()
    hub.rate = None
    return dict(os.environ)


@pytest.fixture(scope="session")
def mlx_repo(hub: FakeHub, model_path: Path, tmp_path_factory) -> str:
    """SmolLM2 as an MLX folder (``gguf_to_folder``) beside files serving never needs."""
    pytest.importorskip("mlx_lm")
    from butter_backend_mlx.checkpoint import gguf_to_folder

    folder = gguf_to_folder(model_path, tmp_path_factory.mktemp("smollm2-mlx"))
    files: dict[str, bytes | Path] = {p.name: p for p in folder.iterdir()}
    files.update({"README.md": b"# SmolLM2 for MLX\n", ".gitattributes": b"*.bin lfs\n",
                  "pytorch_model.bin": b"torch weights", "original/consolidated.pth": b"pth"})
    hub.add(MLX_REPO, files)
    return MLX_REPO

