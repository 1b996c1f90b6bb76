"""``/v1/completions`` ``suffix`` where the vocabulary has fill-in-the-middle tokens.

SmolLM2 has none (its StarCoder-style control tokens stop at ``<empty_output>``; the
``<fim_*>`` ones were dropped), so ``suffix`` is a 400 on it (test_completion_prompts).
To serve FIM through the real GGUF back end anyway, the test copies the checkpoint and
adds the GGUF keys a FIM model carries, ``tokenizer.ggml.fim_{pre,suf,mid}_token_id``,
naming three of its control tokens. llama.cpp then reports them as FIM tokens, and the
prompt must be laid out prefix-suffix-middle as llama-server's ``/infill`` does.
"""

from __future__ import annotations

import struct
from pathlib import Path

import llama_cpp
import openai
import pytest

FIM = (5, 6, 7)  # <file_sep>, <filename>, <gh_stars>: control tokens, not end-of-generation
GGUF_UINT32, GGUF_STRING = 4, 8
PADDED_TO = 256  # a multiple of any tensor-data alignment: the data section keeps its place


def _key(name: str, kind: int) -> bytes:
    data = name.encode()
    return struct.pack("<Q", len(data)) + data + struct.pack("<I", kind)


def with_keys(source: Path, target: Path, values: dict[str, int]) -> None:
    """Copy a GGUF file with uint32 metadata ``values`` added in front of its own."""
    data = source.read_bytes()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data)
    assert magic == b"GGUF" and version >= 2
    added = b"".join(_key(k, GGUF_UINT32) + struct.pack("<I", v) for k, v in values.items())
    pad = _key("butter.test.padding", GGUF_STRING)
    fill = -(len(added) + len(pad) + 8) % PADDED_TO
    added += pad + struct.pack("<Q", fill) + b" " * fill
    header = struct.pack("<4sIQQ", magic, version, n_tensors, n_kv + len(values) + 1)
    target.write_bytes(header + added + data[struct.calcsize("<4sIQQ"):])


@pytest.fixture(scope="module")
def fim_model(model_path, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    with_keys(model_path, path, dict(zip(
        ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
         "tokenizer.ggml.fim_mid_token_id"), FIM)))
    return path


@pytest.fixture(scope="module")
def plain_ids(fim_model):
    """Token ids of text as text (special-token texts not parsed)."""
    vocab = llama_cpp.Llama(model_path=str(fim_model), vocab_only=True, verbose=False)
    native = vocab._model.vocab
    fim = (llama_cpp.llama_vocab_fim_pre(native), llama_cpp.llama_vocab_fim_suf(native),
           llama_cpp.llama_vocab_fim_mid(native))
    assert fim == FIM, "llama.cpp does not read the added FIM keys"
    return lambda text: vocab.tokenize(text.encode(), add_bos=False, special=False)


def test_suffix_fills_in_the_middle_laid_out_as_llama_server(start_server, fim_model,
                                                              plain_ids) -> None:
    server = start_server(model=str(fim_model))
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=120)
    model = server.models()[0]["id"]
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    layout = [FIM[0], *plain_ids(prefix), FIM[1], *plain_ids(suffix), FIM[2]]
    filled = client.completions.create(model=model, prompt=prefix, suffix=suffix,
                                       max_tokens=8, temperature=0)
    assert filled.usage.prompt_tokens == len(layout)
    by_ids = client.completions.create(model=model, prompt=layout, max_tokens=8,
                                       temperature=0)
    assert filled.choices[0].text == by_ids.choices[0].text
    # Client text that spells a FIM token stays text: it is not a second <FIM_SUF>.
    forged = "x = 1  # <filename> <gh_stars>"
    reply = client.completions.create(model=model, prompt=forged, suffix="", max_tokens=1)
    assert reply.usage.prompt_tokens == len(plain_ids(forged)) + 3
    assert len(plain_ids(forged)) > 4
