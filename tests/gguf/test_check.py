"""The GGUF pre-check refuses what llama.cpp would refuse from a file's structure."""

import ctypes
import glob
import os
import struct

import llama_cpp
import pytest

from butter.gguf import GGML_TYPES, GGUFFormatError, check_gguf


def test_the_type_table_matches_the_linked_ggml():
    library = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib",
                                     "libggml-base.so*"))[0]
    ggml = ctypes.CDLL(library)
    ggml.ggml_blck_size.restype = ctypes.c_int64
    ggml.ggml_type_size.restype = ctypes.c_size_t
    for kind, (block, size) in GGML_TYPES.items():
        assert (ggml.ggml_blck_size(kind), ggml.ggml_type_size(kind)) == (block, size), kind


def test_the_shipped_model_passes_and_says_its_context(model_path):
    header = check_gguf(model_path)
    assert header.architecture == "llama" and header.context_length == 8192


@pytest.mark.parametrize("cut", [1, 4096, 50_000_000])
def test_a_truncated_file_is_refused_without_sizes(tmp_path, model_path, cut):
    data = model_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-cut])
    with pytest.raises(GGUFFormatError, match="truncated") as info:
        check_gguf(path)
    assert not any(c.isdigit() for c in str(info.value))


def test_a_moved_tensor_offset_is_refused(tmp_path, model_path):
    data = bytearray(model_path.read_bytes())
    # The first tensor's offset is the u64 right after its type; find it by walking.
    header = check_gguf(model_path)
    assert header.n_tensors > 1
    needle = b"token_embd.weight"
    at = data.index(needle) + len(needle)
    (n_dims,) = struct.unpack_from("<I", data, at)
    offset_at = at + 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, offset_at, 64)
    path = tmp_path / "moved.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="not where the table says"):
        check_gguf(path)
