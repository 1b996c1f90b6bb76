"""Names the hub tests share (the repositories of ``tests/hub/conftest.py``) and a runner
for the ``butter`` command."""

from __future__ import annotations

import subprocess
import sys

GGUF_REPO = "lab/smollm2-gguf"
GGUF_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
GATED_REPO = "lab/gated-gguf"
GATED_TOKEN = "hf_lab_token"
MLX_REPO = "lab/smollm2-mlx"


def butter(*args: str, env: dict[str, str], timeout: float = 120,
           ) -> subprocess.CompletedProcess:
    """Run the ``butter`` command with ``env``; its output as text."""
    return subprocess.run([sys.executable, "-m", "butter", *args], env=env, timeout=timeout,
                          capture_output=True, text=True)
