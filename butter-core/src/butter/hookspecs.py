"""Hook specifications: the whole plugin contract of butter, and nothing else.

Plugins are modules (or objects) registered under the ``butter`` entry-point group.
Call hooks with keywords; arguments only ever grow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from butter.backend import Backend
    from butter.chat.recovery import ToolFormat
    from butter.kvcodec import KVCodec
    from butter.resolve import ResolvedModel

PROJECT = "butter"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register: Callable[[Backend], None]) -> None:
    """Register model back ends.

    Call ``register(backend)`` once per back end. A back end has a ``name`` and must
    not import its native library before ``backend.load`` is called, so that
    listing plugins works on machines without it.
    """


@hookspec
def register_kv_codecs(register: Callable[[str, KVCodec], None]) -> None:
    """Register KV-cache codecs by name: ``register(name, codec)``.

    A codec (:class:`butter.kvcodec.KVCodec`) describes how keys and values are stored
    (``raw``, ``affine8``…). A back end that cannot run a codec logs it once and serves
    ``raw``.
    """


@hookspec(firstresult=True)
def parse_kv_codec(name: str) -> KVCodec | None:
    """The codec a recipe name spells (``aura4v2``), for families too large to list.

    Return ``None`` for a name this family does not claim; raise
    :class:`butter.kvcodec.InvalidCodecError` with the reason for one it claims but cannot
    take (``aura9v1``).
    """


@hookspec
def register_tool_formats(register: Callable[[ToolFormat], None]) -> None:
    """Register tool-call markup formats recovered from model text.

    ``register(format)`` with an object following ``butter.chat.recovery.ToolFormat``.
    """


@hookspec(firstresult=True)
def resolve_model(model_id: str) -> ResolvedModel | None:
    """Turn a model id (path, alias, hub id in the local cache) into a local checkpoint.

    Return ``None`` when this resolver does not know the id; the first non-``None``
    answer wins. Never download anything.
    """
