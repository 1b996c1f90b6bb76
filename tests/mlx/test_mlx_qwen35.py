"""The MLX back end on the tiny Qwen3.5 and Qwen3.5-MoE: the HF folder as Qwen ships it
(settings under ``text_config``, weights under ``model.language_model``) loads through
mlx-lm's own loader and answers through a real server; so do Qwen3.5 GGUFs, through
mx.load into the same mlx-lm class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import reference_llama

from butter.library import Model

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

IM_END, ENDOFTEXT = 151645, 151643
PROMPT = [151644, 872, 198, 9707, 1879, 374, 264, 1273, 13, 151645, 198, 151644, 77091, 198]


def _mlx_logits(folder: Path) -> np.ndarray:
    """mlx-lm's own model on the folder, in float32, over PROMPT."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    network, _ = load_model(folder)
    network.set_dtype(mx.float32)
    return np.array(network(mx.array([PROMPT]))[0])


def _llama_logits(gguf: Path) -> np.ndarray:
    model = reference_llama(gguf, n_ctx=256, logits_all=True)
    model.eval(PROMPT)
    return np.array(model.scores[:len(PROMPT)])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_gguf_computes_what_the_folder_computes(request, moe):
    """The conversion is right: llama.cpp on the F16 GGUF and mlx-lm on the HF folder give
    the same next-token distributions (value-head order, -exp(A_log), +1 norms, experts)."""
    kind = "tiny_qwen35_moe" if moe else "tiny_qwen35"
    folder = request.getfixturevalue(f"{kind}_folder")
    gguf = request.getfixturevalue(f"{kind}_gguf")
    ours, theirs = _mlx_logits(folder), _llama_logits(gguf)
    for position, (a, b) in enumerate(zip(ours, theirs)):
        assert np.corrcoef(a, b)[0, 1] > 0.998, position
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(ours, theirs))
    assert agree >= len(PROMPT) - 1


def test_the_folder_loads_with_its_nested_settings(tiny_qwen35_folder):
    with Model.load(str(tiny_qwen35_folder), backend="mlx") as model:
        info = model.info
        assert info.architecture == "qwen3_5"
        assert info.n_ctx_train == 262144 and info.n_vocab == 151936
        assert not info.can_rewind  # Gated DeltaNet state cannot be cut back
        native = model.engine._runtime._model
        assert native.kv_shape() == (1, 2, 32)  # only the full-attention layer caches KV
        assert native.is_end_of_generation(IM_END) and native.is_end_of_generation(ENDOFTEXT)
        assert not native.is_end_of_generation(151667)  # <think>
        assert native.tokenize("<think>", add_special=False, parse_special=True) == [151667]
        answer = model.generate([{"role": "user", "content": "Hi"}], max_tokens=5,
                                temperature=0, ignore_eos=True)
        assert answer.usage.completion_tokens == 5


@pytest.mark.parametrize("fixture", ["tiny_qwen35_folder", "tiny_qwen35_moe_folder",
                                     "tiny_qwen35_gguf_q4"])
def test_a_server_answers_chat_on_the_folder(request, fixture):
    """Two clients at once, one streaming, through ``butter serve --backend mlx``."""
    from conftest import ServerProcess
    from support.six_tokens import anthropic_six_tokens, openai_six_tokens

    checkpoint = request.getfixturevalue(fixture)
    server = ServerProcess("--backend", "mlx", "--parallel", "2", model=str(checkpoint),
                           timeout=180)
    try:
        served = server.models()[0]
        assert served["butter"]["backend"] == "mlx"
        messages = [{"role": "user", "content": "Say hello."}]
        reply, _, _ = openai_six_tokens(server, served["id"], messages)
        anthropic_six_tokens(server, served["id"], messages, reply.usage.prompt_tokens)
    finally:
        server.stop()


@pytest.mark.parametrize("fixture", ["tiny_qwen35_gguf", "tiny_qwen35_gguf_q8",
                                     "tiny_qwen35_gguf_q4", "tiny_qwen35_moe_gguf"])
def test_mlx_computes_what_llama_cpp_computes_on_a_qwen35_gguf(request, fixture):
    """mlx-lm's qwen3_5 class on a Qwen3.5 GGUF through mx.load, llama.cpp's conversion
    steps undone (value-head order, -exp(A_log), squeezed conv1d), quantized layers kept."""
    from butter_backend_mlx.checkpoint import load_gguf

    gguf = request.getfixturevalue(fixture)
    checkpoint = load_gguf(gguf, fixture)
    assert checkpoint.config["model_type"] == ("qwen3_5_moe" if "moe" in fixture
                                               else "qwen3_5")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    quantized = fixture.endswith(("_q8", "_q4"))
    if quantized:  # quantized layers stay quantized
        assert any(name.endswith(".scales")
                   for name, _ in tree_flatten(checkpoint.model.parameters()))

    ours = np.array(checkpoint.model(mx.array([PROMPT]))[0].astype(mx.float32))
    theirs = _llama_logits(gguf)
    # llama.cpp multiplies quantized weights by 8-bit-quantized activations, MLX by float.
    floor = {"_q8": 0.99, "_q4": 0.97}.get(fixture[-3:], 0.999)
    for position, (a, b) in enumerate(zip(ours, theirs)):
        assert np.corrcoef(a, b)[0, 1] > floor, position
    assert sum(int(a.argmax() == b.argmax()) for a, b in zip(ours, theirs)) >= len(PROMPT) - 1
    text = "Hello <think> world\n\n  Äpfel ½ 🦙.cpp <|im_end|>"
    import llama_cpp

    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    assert (checkpoint.tokenizer.encode(text, add_special_tokens=False).ids
            == vocab.tokenize(text.encode(), add_bos=False, special=True))


def test_quantized_columns_move_by_whole_groups():
    """A real Qwen3.5's value heads (128 wide) span whole quantization groups: ssm_out's
    columns are reordered in the quantized form, exactly."""
    import mlx.core as mx

    from butter_backend_mlx.qwen35_gguf import _columns, _untile

    config = {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
    dense = mx.random.normal((8, 4 * 64), key=mx.random.key(0))
    for bits in (4, 8):
        weight, scales, biases = mx.quantize(dense, group_size=32, bits=bits)
        weights = {"t.weight": weight, "t.scales": scales, "t.biases": biases}
        _columns(weights, "t", config, 64)
        assert set(weights) == {"t.weight", "t.scales", "t.biases"}
        got = mx.dequantize(weights["t.weight"], weights["t.scales"], weights["t.biases"],
                            group_size=32, bits=bits)
        want = _untile(mx.dequantize(weight, scales, biases, group_size=32, bits=bits), 1,
                       config, 64)
        assert mx.array_equal(got, want)
