"""KV codecs as llama.cpp cache types (``type_k`` / ``type_v``), with flash attention.

llama.cpp quantizes its cache in blocks of 32 elements with one float16 scale (``q8_0``,
``q5_0``, ``q4_0``) and, in the pinned version, Hadamard-rotates every quantized cache
whose head size is a multiple of 64. So ``affine8`` / ``affine4`` map to ``q8_0`` / ``q4_0``,
and an AURA recipe maps each side to the narrowest llama.cpp type holding at least its
bits (``aura8v4`` to ``q8_0`` / ``q4_0``, ``aura4v2`` to ``q4_0`` / ``q4_0``). Codec
families llama.cpp has no equivalent for are served raw. Imports no native code.
"""

from __future__ import annotations

import attrs

from butter.kvcodec import KVCodec

# name: (ggml type id, bits per element with the block scale, nominal bits)
CACHE_TYPES = {"f16": (1, 16.0, 16), "q8_0": (8, 8.5, 8), "q5_0": (6, 5.5, 5),
               "q4_0": (2, 4.5, 4)}
MAPPED_FAMILIES = frozenset({"affine", "aura"})


@attrs.frozen
class CacheTypes:
    key: str
    value: str

    @property
    def quantized(self) -> bool:
        return (self.key, self.value) != ("f16", "f16")

    def ids(self) -> tuple[int, int]:
        return CACHE_TYPES[self.key][0], CACHE_TYPES[self.value][0]

    def token_bytes(self, key_elements: int, value_elements: int) -> int:
        bits = key_elements * CACHE_TYPES[self.key][1] \
            + value_elements * CACHE_TYPES[self.value][1]
        return int(-(-bits // 8))

    def __str__(self) -> str:
        return f"keys {self.key}, values {self.value}"


RAW_TYPES = CacheTypes("f16", "f16")


def _narrowest(bits: int) -> str:
    if bits >= 16:
        return "f16"
    if bits > 5:
        return "q8_0"
    return "q5_0" if bits == 5 else "q4_0"


def cache_types(codec: KVCodec) -> CacheTypes | None:
    """The llama.cpp cache types storing ``codec``, or None (served raw)."""
    if codec.raw:
        return RAW_TYPES
    if codec.family not in MAPPED_FAMILIES:
        return None
    return CacheTypes(_narrowest(codec.key_bits), _narrowest(codec.value_bits))


def describe_mapping(codec: KVCodec) -> str:
    """The one log line saying how ``codec`` is stored here."""
    types = cache_types(codec)
    if types is None:
        return (f"KV codec {codec.name}: llama.cpp has no equivalent of the {codec.family} "
                "family; serving the cache raw (f16)")
    if not types.quantized:
        return f"KV codec {codec.name}: llama.cpp f16 cache"
    notes = []
    if codec.family == "aura":
        notes.append("llama.cpp applies its own Hadamard rotation; the float16 sinks and "
                     "recent tokens are not kept")
        stored = (CACHE_TYPES[types.key][2], CACHE_TYPES[types.value][2])
        if stored != (codec.key_bits, codec.value_bits):
            notes.append(f"{codec.key_bits}-bit keys / {codec.value_bits}-bit values rounded "
                         "up to the nearest llama.cpp types")
    else:
        notes.append("llama.cpp Hadamard-rotates quantized caches")
    return f"KV codec {codec.name} as llama.cpp cache types: {types}, flash attention on " \
           f"({'; '.join(notes)})"
