"""Hub ids and the choice of file: pure functions, no network (butter.hub)."""

from __future__ import annotations

import pytest

from butter.errors import ModelLoadError, ModelNotFoundError
from butter.hub import (
    HubId,
    RemoteFile,
    choose_gguf,
    files_to_fetch,
    parse_hub_id,
)


@pytest.mark.parametrize(("text", "repo", "quant", "filename"), [
    ("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-0.8B", None, None),
    ("ggml-org/gemma-3-1b-it-GGUF:q4_k_m", "ggml-org/gemma-3-1b-it-GGUF", "q4_k_m", None),
    ("lab/repo/sub/m-Q8_0.gguf", "lab/repo", None, "sub/m-Q8_0.gguf"),
])
def test_hub_ids_parse(text, repo, quant, filename):
    assert parse_hub_id(text) == HubId(text=text, repo_id=repo, quant=quant, filename=filename)


@pytest.mark.parametrize("text", [
    "smollm2", "/models/m.gguf", "./lab/repo", "~/lab/repo", "lab/repo:", "lab/repo/m.bin",
    "lab/repo/../m.gguf", "lab/repo/x.gguf:Q4_0", "lab--x/repo", "lab/repo.", " lab/repo",
])
def test_paths_and_aliases_are_not_hub_ids(text):
    assert parse_hub_id(text) is None


PATHS = ["README.md", "m-Q4_1.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-IQ4_XS.gguf",
         "mmproj-m-f16.gguf", "big/m-Q2_K-00001-of-00002.gguf",
         "big/m-Q2_K-00002-of-00002.gguf"]


def choose(quant=None, paths=PATHS):
    return choose_gguf(HubId(text="lab/m", repo_id="lab/m", quant=quant), paths)


def test_without_a_quant_llama_servers_default():
    assert choose() == "m-Q4_K_M.gguf"
    assert choose(paths=[p for p in PATHS if "K_M" not in p]) == "m-Q8_0.gguf"
    assert choose(paths=["b-f16.gguf", "a-IQ2_M.gguf", "mmproj-x.gguf"]) == "a-IQ2_M.gguf"


def test_a_quant_in_any_case_picks_the_one_file_carrying_it():
    assert choose("q4_1") == "m-Q4_1.gguf"
    assert choose("Q2_K") == "big/m-Q2_K-00001-of-00002.gguf"
    assert choose("XS") == "m-IQ4_XS.gguf"  # a whole word after "_"; IQ4 is not Q4
    with pytest.raises(ModelNotFoundError, match="no .gguf file carries Q4_XS"):
        choose("Q4_XS")


def test_several_matches_or_none_list_what_the_repository_has():
    with pytest.raises(ModelLoadError) as several:
        choose("Q4_1", PATHS + ["m-instruct-Q4_1.gguf"])
    assert "2 files carry Q4_1: m-Q4_1.gguf, m-instruct-Q4_1.gguf" in str(several.value)
    with pytest.raises(ModelNotFoundError) as none:
        choose("Q6_K")
    assert "its .gguf files: big/m-Q2_K-00001-of-00002.gguf" in str(none.value)


def test_a_split_gguf_downloads_every_part_its_first_last():
    files = files_to_fetch(HubId(text="lab/m:Q2_K", repo_id="lab/m", quant="Q2_K"),
                           [RemoteFile(p, 1) for p in PATHS])
    assert [f.path for f in files] == ["big/m-Q2_K-00002-of-00002.gguf",
                                       "big/m-Q2_K-00001-of-00002.gguf"]


def test_a_checkpoint_takes_serving_files_config_last():
    listing = [RemoteFile(p, 1) for p in (
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja", "README.md",
        "pytorch_model.bin", "modeling_custom.py", "original/consolidated.pth")]
    files = [f.path for f in files_to_fetch(HubId(text="lab/m", repo_id="lab/m"), listing)]
    assert files == ["chat_template.jinja", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "config.json"]


def test_a_repository_without_loadable_weights_or_the_quant_is_refused():
    with pytest.raises(ModelLoadError, match="no weights butter can load"):
        files_to_fetch(HubId(text="lab/m", repo_id="lab/m"),
                       [RemoteFile("config.json", 1), RemoteFile("pytorch_model.bin", 1)])
    with pytest.raises(ModelNotFoundError, match="no .gguf file carries Q4_0"):
        files_to_fetch(HubId(text="lab/m:Q4_0", repo_id="lab/m", quant="Q4_0"),
                       [RemoteFile("config.json", 1), RemoteFile("model.safetensors", 1)])
