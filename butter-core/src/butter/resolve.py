"""The record a model resolver returns: where a checkpoint lives and what kind it is."""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class ResolvedModel:
    """A local checkpoint.

    ``format`` is ``"gguf"`` (one file), ``"hf"`` (a directory with a config and
    safetensors) or ``"empty"`` (a directory that holds no weights: loading it fails
    with that reason). ``named_path`` is True when the id itself was a filesystem
    path; aliases, cached hub ids and ids a plugin knows are names, not paths, and
    only names (or paths under ``--models-dir``) may be swapped in by a request.
    """

    model_id: str
    path: Path
    format: str
    named_path: bool = False

    @property
    def served_id(self) -> str:
        """The id ``/v1/models`` shows: a path's file or folder name (its stem), never the
        path; a name as it was given."""
        if not self.named_path:
            return self.model_id
        return self.path.stem if self.path.is_file() else self.path.name

    @property
    def key(self) -> str:
        """What makes two ids the same checkpoint (an alias and its file path are one)."""
        return str(self.path.resolve())
