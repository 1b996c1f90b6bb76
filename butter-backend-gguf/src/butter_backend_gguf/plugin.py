"""Registers the GGUF back end. Imports nothing heavy: llama_cpp loads in ``load``."""

from __future__ import annotations

from butter.hookspecs import hookimpl
from butter.resolve import ResolvedModel


class GGUFBackend:
    name = "gguf"
    priority = 10

    def can_load(self, resolved: ResolvedModel) -> bool:
        return resolved.format == "gguf"

    def load(self, resolved: ResolvedModel, *, threads: int | None = None):
        from butter_backend_gguf.native import load_model

        return load_model(resolved, threads=threads)


@hookimpl
def register_backends(register) -> None:
    register(GGUFBackend())


@hookimpl
def register_kv_codecs(register) -> None:
    # llama.cpp stores the KV raw (f16) here; quantised cache types arrive with the codecs issue.
    pass
