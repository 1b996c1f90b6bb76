"""Registers the GGUF back end. Imports nothing heavy: llama_cpp loads in ``load``."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from butter.backend import CheckpointFacts, SessionLayout
from butter.gguf import read_header
from butter.hookspecs import hookimpl
from butter.kvcodec import KVCodec
from butter.resolve import ResolvedModel
from butter_backend_gguf import settings


class GGUFBackend:
    name = "gguf"
    priority = 10
    options = settings.OPTIONS
    limits = settings.LIMITS
    takes_threads = True
    kv_windows = True  # llama.cpp's context shift
    decode_paths = frozenset({"compressed"})  # llama.cpp attends on its cache as stored

    def session_layout(self, options: Mapping[str, object], parallel: int) -> SessionLayout:
        return settings.session_layout(options, parallel)

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed (pip install 'butter-core[gguf]')"
        return None

    def can_load(self, resolved: ResolvedModel) -> bool:
        return resolved.format == "gguf" and self.unavailable() is None

    def precheck(self, resolved: ResolvedModel) -> CheckpointFacts:
        """Refuse a truncated or corrupt file before anything is freed or loaded."""
        header = read_header(resolved)
        return CheckpointFacts(architecture=header.architecture,
                               context_length=header.context_length)

    def kv_storage(self, codec: KVCodec) -> str | None:
        """How llama.cpp stores ``codec`` (its cache types), or None: served raw."""
        from butter_backend_gguf.kvtypes import cache_types

        types = cache_types(codec)
        return None if types is None else str(types)

    def load(self, resolved: ResolvedModel, *, threads: int | None = None):
        from butter_backend_gguf.native import load_model

        return load_model(resolved, threads=threads)


@hookimpl
def register_backends(register) -> None:
    register(GGUFBackend())


