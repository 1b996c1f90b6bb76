"""Registers the GGUF back end. Imports nothing heavy: llama_cpp loads in ``load``."""

from __future__ import annotations

from butter.errors import ModelLoadError
from butter.hookspecs import hookimpl
from butter.resolve import ResolvedModel
from butter_backend_gguf.check import GGUFFormatError, check_gguf


class GGUFBackend:
    name = "gguf"
    priority = 10

    def can_load(self, resolved: ResolvedModel) -> bool:
        return resolved.format == "gguf"

    def precheck(self, resolved: ResolvedModel) -> None:
        """Refuse a truncated or corrupt file before anything is freed or loaded."""
        try:
            check_gguf(resolved.path)
        except (GGUFFormatError, OSError) as exc:
            raise ModelLoadError(resolved.model_id, str(exc)) from None

    def load(self, resolved: ResolvedModel, *, threads: int | None = None):
        from butter_backend_gguf.native import load_model

        self.precheck(resolved)
        return load_model(resolved, threads=threads)


@hookimpl
def register_backends(register) -> None:
    register(GGUFBackend())


@hookimpl
def register_kv_codecs(register) -> None:
    # llama.cpp stores the KV raw (f16) here; quantised cache types arrive with the codecs issue.
    pass
