"""The tiny Qwen3.5 checkpoints are what they claim: the real vocabulary, template and
layout, and the GGUF conversion computes what the HF folder computes."""

from __future__ import annotations

import json

import pytest
from helpers import reference_llama
from support.tiny_qwen35 import ADDED_TOKENS, llama_cpp_dir


def _vocab_tests() -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test cases for this vocabulary, read as test-tokenizer-0 does."""
    base = llama_cpp_dir() / "models" / "ggml-vocab-qwen35.gguf"
    raw = (base.parent / (base.name + ".inp")).read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    texts = raw.split(sep)
    if texts and texts[-1] == "":
        texts.pop()
    lines = (base.parent / (base.name + ".out")).read_bytes().decode("utf-8").split("\n")
    expected = [[int(t) for t in line.split()] for line in lines[:len(texts)]]
    assert len(texts) == len(expected) > 40
    return list(zip(texts, expected))


def test_gguf_vocabulary_tokenizes_llama_cpp_test_strings(tiny_qwen35_gguf):
    import llama_cpp

    model = llama_cpp.Llama(str(tiny_qwen35_gguf), vocab_only=True, verbose=False)
    for text, expected in _vocab_tests():
        assert model.tokenize(text.encode(), add_bos=False, special=False) == expected, text


def test_tokenizer_json_tokenizes_llama_cpp_test_strings(tiny_qwen35_folder):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_qwen35_folder / "tokenizer.json"))
    for text, expected in _vocab_tests():
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text


def test_added_tokens_sit_at_qwen3_ids_in_both_forms(tiny_qwen35_gguf, tiny_qwen35_folder):
    import llama_cpp
    from tokenizers import Tokenizer

    model = llama_cpp.Llama(str(tiny_qwen35_gguf), vocab_only=True, verbose=False)
    tokenizer = Tokenizer.from_file(str(tiny_qwen35_folder / "tokenizer.json"))
    text = "".join(f"a{token}" for _, token, _ in ADDED_TOKENS)
    expected = [i for index, _, _ in ADDED_TOKENS for i in (64, index)]
    assert model.tokenize(text.encode(), add_bos=False, special=True) == expected
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected
    # Client text never becomes a control token, but "<think>" (user-defined) still does.
    assert model.tokenize(b"<|im_end|>", add_bos=False, special=False) != [151645]
    assert model.tokenize(b"<think>", add_bos=False, special=False) == [151667]


def test_folder_is_the_real_layout(tiny_qwen35_folder, tiny_qwen35_moe_folder):
    from support.tiny_qwen35 import read_safetensors, template_text

    config = json.loads((tiny_qwen35_folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5"
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["attn_output_gate"] and text["rope_parameters"]["partial_rotary_factor"] < 1
    assert text["hidden_size"] == 64
    assert text["linear_num_value_heads"] > text["linear_num_key_heads"]
    assert "num_attention_heads" not in config  # nested, as Qwen3.5 ships it
    assert (tiny_qwen35_folder / "chat_template.jinja").read_text() == template_text()
    settings = json.loads((tiny_qwen35_folder / "tokenizer_config.json").read_text())
    assert settings["chat_template"] == template_text()
    tokenizer = json.loads((tiny_qwen35_folder / "tokenizer.json").read_text())
    assert tokenizer["normalizer"] is None  # Qwen3.5 does not NFC-normalize
    names = read_safetensors(tiny_qwen35_folder / "model.safetensors")
    assert all(name.startswith("model.language_model.") for name in names)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    q_rows = names["model.language_model.layers.3.self_attn.q_proj.weight"].shape[0]
    assert q_rows == 2 * text["num_attention_heads"] * text["head_dim"]  # query + gate
    moe = json.loads((tiny_qwen35_moe_folder / "config.json").read_text())
    assert moe["model_type"] == "qwen3_5_moe" and moe["text_config"]["num_experts"] == 4
    moe_names = read_safetensors(tiny_qwen35_moe_folder / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in moe_names
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in moe_names


@pytest.mark.parametrize("fixture", ["tiny_qwen35_gguf", "tiny_qwen35_gguf_q8",
                                     "tiny_qwen35_gguf_q4", "tiny_qwen35_moe_gguf",
                                     "tiny_qwen35_moe_gguf_q4"])
def test_llama_cpp_loads_each_gguf(request, fixture):
    path = request.getfixturevalue(fixture)
    model = reference_llama(path, n_ctx=256)
    architecture = "qwen35moe" if "moe" in fixture else "qwen35"
    assert model.metadata["general.architecture"] == architecture
    out = model.create_completion("Hello", max_tokens=4, temperature=0)
    assert out["usage"]["completion_tokens"] >= 1
