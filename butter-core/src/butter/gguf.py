"""A structural check of a GGUF file, without llama.cpp (both back ends read GGUF).

Walks the header, the metadata and the tensor table with the rules llama.cpp's
``gguf_init_from_file`` and model loader apply, and checks that every tensor's
data lies inside the file. A swap runs it before the resident model is freed, so a
file llama.cpp would refuse is refused while the old model keeps serving. Reasons
name no paths, sizes or tensor names: they reach clients.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import attrs

from butter.errors import ModelLoadError
from butter.resolve import ResolvedModel

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME, terminator included
# gguf_type ids → fixed sizes (8 = string, 9 = array are variable).
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UNSIGNED = {0: "<B", 2: "<H", 4: "<I", 10: "<Q"}
_STRING, _ARRAY = 8, 9
# ggml_type id → (elements per block, bytes per block), as in ggml.h / ggml.c's type
# traits. tests/gguf/test_check.py compares this table with the linked libggml.
GGML_TYPES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
    8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
    13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74),
    18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
}
_INT64_MAX = 2**63 - 1


class GGUFFormatError(ValueError):
    """The file is not a well-formed, complete GGUF."""


@attrs.frozen
class GGUFHeader:
    """What the header says, for checks made before loading (``--max-context``)."""

    architecture: str | None
    context_length: int | None
    n_tensors: int
    tensor_types: frozenset[int] = frozenset()  # ggml_type ids of its tensors
    tokenizer_model: str | None = None  # tokenizer.ggml.model: gpt2, llama...


def _read(handle: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise GGUFFormatError("the file ends inside its header")
    return struct.unpack(fmt, data)


def _read_string(handle: BinaryIO, limit: int) -> str:
    (length,) = _read(handle, "<Q")
    if length > limit:
        raise GGUFFormatError("a string in its header is implausibly long")
    data = handle.read(length)
    if len(data) != length:
        raise GGUFFormatError("the file ends inside its header")
    return data.decode("utf-8", errors="replace")


def _skip(handle: BinaryIO, size: int, end: int) -> None:
    if handle.tell() + size > end:
        raise GGUFFormatError("the file ends inside its metadata")
    handle.seek(size, 1)


def _read_value(handle: BinaryIO, kind: int, end: int) -> object:
    """Read one value; return unsigned integers and short strings, skip the rest."""
    if kind in _UNSIGNED:
        return _read(handle, _UNSIGNED[kind])[0]
    if kind in _SCALARS:
        _skip(handle, _SCALARS[kind], end)
        return None
    if kind == _STRING:
        (length,) = _read(handle, "<Q")
        if length <= 256:
            handle.seek(-8, 1)
            return _read_string(handle, 256)
        _skip(handle, length, end)
        return None
    if kind == _ARRAY:
        item_kind, count = _read(handle, "<IQ")
        if item_kind in _SCALARS:
            _skip(handle, _SCALARS[item_kind] * count, end)
        elif item_kind == _STRING:
            for _ in range(count):
                (length,) = _read(handle, "<Q")
                _skip(handle, length, end)
        else:
            raise GGUFFormatError("its metadata holds an array of an unsupported type")
        return None
    raise GGUFFormatError("its metadata holds a value of an unknown type")


def check_gguf(path: Path) -> GGUFHeader:
    """Raise :class:`GGUFFormatError` with a reason unless ``path`` is a complete GGUF."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if handle.read(4) != MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = _read(handle, "<IQQ")
        if version not in (2, 3):
            raise GGUFFormatError("unsupported GGUF version")
        alignment = DEFAULT_ALIGNMENT
        values: dict[str, object] = {}
        for _ in range(n_kv):
            key = _read_string(handle, 1 << 16)
            if key in values:
                raise GGUFFormatError("its metadata repeats a key")
            (kind,) = _read(handle, "<I")
            values[key] = _read_value(handle, kind, size)
            if key == "general.alignment":
                alignment = values[key]
                if kind != 4 or not alignment or alignment & (alignment - 1):
                    raise GGUFFormatError("its alignment is not a power of two")
        ends, types = _tensor_ends(handle, n_tensors, alignment, size)
        data_start = -(-handle.tell() // alignment) * alignment
        if data_start + ends > size:
            raise GGUFFormatError("the file is truncated: its tensor data runs past its end")
    arch = values.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    context = values.get(f"{arch}.context_length") if arch else None
    tokenizer = values.get("tokenizer.ggml.model")
    return GGUFHeader(architecture=arch, context_length=context if isinstance(context, int)
                      else None, n_tensors=n_tensors, tensor_types=frozenset(types),
                      tokenizer_model=tokenizer if isinstance(tokenizer, str) else None)


def _tensor_ends(handle: BinaryIO, n_tensors: int, alignment: int,
                 size: int) -> tuple[int, set[int]]:
    """Walk the tensor table; return where the last tensor's data ends (from data start)
    and the tensor types it uses."""
    names: set[str] = set()
    types: set[int] = set()
    expected = 0  # llama.cpp packs tensors in table order, each padded to the alignment
    end = 0
    for _ in range(n_tensors):
        name = _read_string(handle, 1 << 16)
        if len(name.encode()) >= MAX_NAME:
            raise GGUFFormatError("a tensor name is too long")
        if name in names:
            raise GGUFFormatError("a tensor name is repeated")
        names.add(name)
        (n_dims,) = _read(handle, "<I")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError("a tensor has too many dimensions")
        dims = _read(handle, f"<{n_dims}q") if n_dims else ()
        kind, offset = _read(handle, "<IQ")
        if kind not in GGML_TYPES:
            raise GGUFFormatError("a tensor has a type this llama.cpp does not know")
        types.add(kind)
        block, block_bytes = GGML_TYPES[kind]
        elements = 1
        for dim in dims:
            if dim < 0 or (dim and elements > _INT64_MAX // dim):
                raise GGUFFormatError("a tensor has an impossible shape")
            elements *= dim
        if dims and dims[0] % block:
            raise GGUFFormatError("a tensor's rows do not fill whole quantization blocks")
        nbytes = elements // block * block_bytes
        if offset != expected:
            raise GGUFFormatError("a tensor's data is not where the table says")
        end = offset + nbytes
        if end > size:
            raise GGUFFormatError("the file is truncated: its tensor data runs past its end")
        expected = offset + -(-nbytes // alignment) * alignment
    return end, types


def read_header(resolved: ResolvedModel) -> GGUFHeader:
    """:func:`check_gguf` for a back end's pre-check: a refusal is a ``ModelLoadError``
    with a reason that names no path."""
    try:
        return check_gguf(resolved.path)
    except GGUFFormatError as exc:
        raise ModelLoadError(resolved.model_id, str(exc)) from None
    except OSError:
        raise ModelLoadError(resolved.model_id, "the file cannot be read") from None
