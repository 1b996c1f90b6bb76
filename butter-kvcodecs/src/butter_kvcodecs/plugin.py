"""Registers butter's KV codecs: ``affine8``, ``affine4``, ``aura`` and ``auraNvM``.

``raw`` is core's own (``butter.kvcodec``). The records say what is stored; each back end
does the arithmetic its own way (see the package README for the AURA recipe and the
measurements behind its defaults).
"""

from __future__ import annotations

import re

from butter.hookspecs import hookimpl
from butter.kvcodec import InvalidCodecError, KVCodec

GROUP_SIZE = 64  # mx.quantize's default group; SmolLM2's head dimension
AURA_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
AURA_SINKS = 4  # first tokens kept float16 (attention sinks)
AURA_RECENT = 32  # newest tokens kept float16 (KIVI's residual), until they age out
AURA_DEFAULT = "aura4v4"
_AURA = re.compile(r"aura(\d+)v(\d+)")


def affine(bits: int) -> KVCodec:
    return KVCodec(name=f"affine{bits}", family="affine", key_bits=bits, value_bits=bits,
                   group_size=GROUP_SIZE,
                   description=f"{bits}-bit group-wise affine keys and values")


def aura(key_bits: int, value_bits: int, name: str | None = None) -> KVCodec:
    for bits in (key_bits, value_bits):
        if bits not in AURA_BITS:
            allowed = ", ".join(map(str, AURA_BITS))
            raise InvalidCodecError(f"aura{key_bits}v{value_bits}: {bits}-bit is not a "
                                    f"width AURA packs ({allowed})")
    return KVCodec(name=name or f"aura{key_bits}v{value_bits}", family="aura",
                   key_bits=key_bits, value_bits=value_bits, group_size=GROUP_SIZE,
                   rotate_keys=True, sinks=AURA_SINKS, recent=AURA_RECENT,
                   description=f"Hadamard-rotated {key_bits}-bit keys, {value_bits}-bit "
                               f"values, first {AURA_SINKS} and newest {AURA_RECENT} "
                               "tokens float16")


@hookimpl
def register_kv_codecs(register) -> None:
    register("affine8", affine(8))
    register("affine4", affine(4))
    key_bits, value_bits = map(int, _AURA.fullmatch(AURA_DEFAULT).groups())
    register("aura", aura(key_bits, value_bits, name="aura"))


@hookimpl
def parse_kv_codec(name: str) -> KVCodec | None:
    match = _AURA.fullmatch(name)
    if match is None:
        if name.startswith("aura"):
            raise InvalidCodecError(f"{name!r} is not an AURA recipe: auraNvM, N key bits "
                                    f"and M value bits, each one of "
                                    f"{', '.join(map(str, AURA_BITS))}")
        return None
    return aura(int(match[1]), int(match[2]))
