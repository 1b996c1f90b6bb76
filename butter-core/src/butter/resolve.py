"""The record a model resolver returns: where a checkpoint lives and what kind it is."""

from __future__ import annotations

from pathlib import Path

import attrs



@attrs.frozen
class ResolvedModel:
    """A local checkpoint.

    ``format`` is ``"gguf"`` (one file), ``"hf"`` (a directory with a config and
    safetensors) or ``"empty"`` (a directory that holds no weights: loading it fails
    with that reason).
    """

    model_id: str
    path: Path
    format: str

    @property
    def key(self) -> str:
        """What makes two ids the same checkpoint (an alias and its file path are one)."""
        return str(self.path.resolve())
