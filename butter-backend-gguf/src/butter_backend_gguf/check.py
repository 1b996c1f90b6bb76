"""A cheap structural check of a GGUF file, without llama.cpp.

Walks the header, the metadata and the tensor table, and checks that the file is
long enough to hold the tensor data they describe. A swap runs it before the
resident model is freed, so a truncated or corrupt file is refused while the old
model keeps serving.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# gguf_type ids → fixed sizes (8 = string, 9 = array are variable).
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


class GGUFFormatError(ValueError):
    """The file is not a well-formed, complete GGUF."""


def _read(handle: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise GGUFFormatError("the file ends inside its header")
    return struct.unpack(fmt, data)


def _skip_string(handle: BinaryIO) -> None:
    (length,) = _read(handle, "<Q")
    handle.seek(length, 1)


def _read_string(handle: BinaryIO) -> str:
    (length,) = _read(handle, "<Q")
    if length > 1 << 20:
        raise GGUFFormatError("a metadata key is implausibly long")
    return handle.read(length).decode("utf-8", errors="replace")


def _skip_value(handle: BinaryIO, kind: int) -> int | None:
    """Skip one value; return it when it is an unsigned integer (for general.alignment)."""
    if kind in _SCALARS:
        raw = handle.read(_SCALARS[kind])
        if len(raw) != _SCALARS[kind]:
            raise GGUFFormatError("the file ends inside its metadata")
        return int.from_bytes(raw, "little") if kind in (0, 2, 4, 10) else None
    if kind == _STRING:
        _skip_string(handle)
        return None
    if kind == _ARRAY:
        item_kind, count = _read(handle, "<IQ")
        if item_kind in _SCALARS:
            handle.seek(_SCALARS[item_kind] * count, 1)
        else:
            for _ in range(count):
                _skip_value(handle, item_kind)
        return None
    raise GGUFFormatError(f"unknown metadata type {kind}")


def check_gguf(path: Path) -> None:
    """Raise :class:`GGUFFormatError` with a reason if ``path`` is not a complete GGUF."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if handle.read(4) != MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = _read(handle, "<IQQ")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = _read_string(handle)
            (kind,) = _read(handle, "<I")
            value = _skip_value(handle, kind)
            if key == "general.alignment" and value:
                alignment = value
            if handle.tell() > size:
                raise GGUFFormatError("the file ends inside its metadata")
        last_offset = 0
        for _ in range(n_tensors):
            _skip_string(handle)
            (n_dims,) = _read(handle, "<I")
            if n_dims > _MAX_DIMS:
                raise GGUFFormatError("a tensor has too many dimensions")
            handle.seek(8 * n_dims, 1)
            _, offset = _read(handle, "<IQ")
            last_offset = max(last_offset, offset)
        data_start = -(-handle.tell() // alignment) * alignment
        if data_start + last_offset >= size:
            raise GGUFFormatError(
                f"the file is truncated: tensor data needs more than {data_start + last_offset} "
                f"bytes, the file has {size}"
            )
