"""Registers the KV codecs. Only ``raw`` exists until the codecs issue."""

from __future__ import annotations

import attrs

from butter.hookspecs import hookimpl


@attrs.frozen
class RawCodec:
    """Keys and values stored as the back end's native dtype."""

    name: str = "raw"
    bits: int = 16


@hookimpl
def register_kv_codecs(register) -> None:
    register("raw", RawCodec())
