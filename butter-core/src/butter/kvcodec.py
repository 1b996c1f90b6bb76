"""The KV codec contract: how a runtime may store keys and values (``--kv-cache``).

A codec is a record, not code: the back ends own the arithmetic. Core registers ``raw``
itself (it is the absence of a codec, the default every install must serve);
``butter-kvcodecs`` registers ``affine8``, ``affine4`` and the AURA recipes through the
plugin hooks, and a third-party package registers its own the same way. A back end
says, per codec, how it stores it (``Backend.kv_storage``) or that it cannot, and then
serves ``raw``.
"""

from __future__ import annotations

import attrs

from butter.hookspecs import hookimpl

RAW_BITS = 16
# One float16 scale and one float16 bias per group of quantized elements (mx.quantize).
GROUP_OVERHEAD_BITS = 32


@attrs.frozen
class KVCodec:
    """How one cached token's keys and values are stored.

    ``family`` names the arithmetic: ``raw`` (the back end's float16), ``affine``
    (group-wise affine quantization along the head dimension, per token, a float16 scale
    and bias per ``group_size`` elements, as ``mx.quantize``), ``aura`` (affine after a
    per-layer Hadamard rotation with random signs, applied to post-RoPE keys and to the
    queries; the first ``sinks`` and the newest ``recent`` tokens stay float16), or a
    third party's own. ``key_bits`` and ``value_bits`` are 16 for float16.
    """

    name: str
    family: str = "raw"
    key_bits: int = RAW_BITS
    value_bits: int = RAW_BITS
    group_size: int = 64
    value_group_size: int | None = None  # the values' own group, if not ``group_size``
    rotate_keys: bool = False
    rotate_values: bool = False
    sinks: int = 0
    recent: int = 0
    description: str = ""

    @property
    def raw(self) -> bool:
        return self.key_bits == RAW_BITS and self.value_bits == RAW_BITS

    @property
    def value_group(self) -> int:
        """Elements per scale and bias of the values."""
        return self.value_group_size or self.group_size

    def element_bits(self, bits: int, group: int | None = None) -> float:
        """Bits one element costs at ``bits``, its share of the group's scale and bias in."""
        group = group or self.group_size
        return float(bits) if bits >= RAW_BITS else bits + GROUP_OVERHEAD_BITS / group

    @property
    def bits_per_element(self) -> float:
        """Mean bits per cached key or value element (long contexts: sinks and the recent
        tokens aside)."""
        return (self.element_bits(self.key_bits)
                + self.element_bits(self.value_bits, self.value_group)) / 2

    def token_bytes(self, key_elements: int, value_elements: int) -> int:
        """Bytes one cached token costs when each token holds ``key_elements`` key and
        ``value_elements`` value elements across every layer (float16 raw)."""
        bits = key_elements * self.element_bits(self.key_bits) \
            + value_elements * self.element_bits(self.value_bits, self.value_group)
        return max(1, int(-(-bits // 8)))

    def short(self) -> str:
        """One line for logs and ``butter plugins``."""
        if self.raw:
            return "float16 keys and values"
        groups = f"groups of {self.group_size}" if self.value_group == self.group_size \
            else f"groups of {self.group_size} (values {self.value_group})"
        parts = [f"keys {self.key_bits}-bit, values {self.value_bits}-bit, {groups}"]
        if self.rotate_keys:
            parts.append("Hadamard-rotated keys" + (" and values" if self.rotate_values else ""))
        if self.sinks or self.recent:
            parts.append(f"first {self.sinks} and newest {self.recent} tokens float16")
        return ", ".join(parts)


RAW = KVCodec(name="raw", description="float16 keys and values")


class InvalidCodecError(ValueError):
    """A codec name a recipe family knows the shape of, with values it cannot take."""


@hookimpl
def register_kv_codecs(register) -> None:
    register("raw", RAW)
