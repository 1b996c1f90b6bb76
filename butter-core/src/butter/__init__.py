"""butter: an OpenAI- and Anthropic-compatible LLM inference server.

The library API is importable from here without any back end installed::

    from butter import Model, ModelLoader, ButterServeBackend, ServeServer, ResidentServeBackend
"""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "Model": "butter.library",
    "ModelLoader": "butter.library",
    "GenerationResult": "butter.library",
    "StreamChunk": "butter.library",
    "ButterServeBackend": "butter.serving",
    "ResidentServeBackend": "butter.serving",
    "ServeServer": "butter.http.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'butter' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
