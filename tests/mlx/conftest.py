"""Fixtures of the MLX tests: the shipped GGUF as an MLX folder, and a tiny hybrid model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.absent import skip_without

# Without MLX each file skips, unimported.
pytest_pycollect_makemodule = skip_without(
    "mlx", "mlx_lm", "butter_backend_mlx", reason="MLX is not installed (butter-core[mlx])")


@pytest.fixture(scope="session")
def mlx_folder(tmp_path_factory, model_path) -> Path:
    """SmolLM2 converted from the shipped GGUF: config.json, safetensors, tokenizer."""
    from butter_backend_mlx.checkpoint import gguf_to_folder

    return gguf_to_folder(model_path, tmp_path_factory.mktemp("smollm2-mlx"))


@pytest.fixture(scope="session")
def hybrid_folder(tmp_path_factory, mlx_folder) -> Path:
    """A tiny random-weight LFM2 (short convolutions + attention): recurrent state that
    cannot be trimmed, built from mlx-lm's own architecture, with SmolLM2's vocabulary."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = {
        "model_type": "lfm2", "vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
        "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False, "block_ff_dim": 128, "full_attn_idxs": [1],
        "eos_token_id": [2], "bos_token_id": 1,
    }
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    folder = tmp_path_factory.mktemp("tiny-lfm2")
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(mlx_folder / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def mlx_server():
    """``butter serve --backend mlx`` on the shipped GGUF (through ``mx.load``)."""
    from conftest import ServerProcess

    server = ServerProcess("--backend", "mlx", "--parallel", "2", timeout=180)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loaded():
    """SmolLM2 loaded by the MLX back end from the shipped GGUF (through ``mx.load``)."""
    from butter.library import default_plugins

    plugins = default_plugins()
    model = plugins.backends["mlx"].load(plugins.resolve("smollm2"))
    yield model
    model.close()
