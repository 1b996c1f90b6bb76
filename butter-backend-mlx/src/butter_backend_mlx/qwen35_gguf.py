"""A Qwen3.5 / Qwen3.5-MoE GGUF (llama.cpp's ``qwen35`` / ``qwen35moe``) as mlx-lm's
``qwen3_5`` / ``qwen3_5_moe`` model: the config its metadata describes, and its tensors
under mlx-lm's names with llama.cpp's conversion steps undone.

``convert_hf_to_gguf.py`` stores linear-attention value heads tiled (``[K0, K1, K0, K1]``
for ggml's broadcast) where the HF weights and mlx-lm group them by key head
(``[K0, K0, K1, K1]``); it stores ``ssm_a = -exp(A_log)``, the squeezed ``conv1d`` and
RMSNorm weights with Qwen3.5's ``+ 1`` already added (mlx-lm's norms take them as they
are). Row permutations move quantized rows with their scales and biases unchanged; the
one column permutation (``ssm_out``) of a quantized tensor moves whole quantization
groups, or leaves that layer dequantized when a head is narrower than a group.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from butter.errors import ModelLoadError

ARCHITECTURES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
GROUP_SIZE = 32

_LAYER = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def qwen35_config(meta: dict[str, Any], arch: str, *, tied: bool,
                  model_id: str) -> dict[str, Any]:
    """The mlx-lm config a qwen35 / qwen35moe GGUF's metadata describes."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(model_id, f"its GGUF metadata has no {arch}.{name}")
        return value

    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    interval = int(key("full_attention_interval", 4))
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None and [bool(r) for r in list(recurrent)[:layers]] != [
            bool((i + 1) % interval) for i in range(layers)]:
        raise ModelLoadError(model_id, "its recurrent layers do not follow one "
                             "full-attention interval, which mlx-lm's qwen3_5 needs")
    value_heads = int(key("ssm.time_step_rank"))
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta.get("tokenizer.ggml.tokens") or ()),
        "max_position_embeddings": int(key("context_length", 4096)),
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "full_attention_interval": interval,
        "tie_word_embeddings": tied,
        "rope_parameters": {
            "type": "default",
            "rope_theta": float(key("rope.freq_base", 10000000.0)),
            "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim,
        },
    }
    if arch == "qwen35moe":
        config.update(num_experts=int(key("expert_count")),
                      num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      shared_expert_intermediate_size=int(
                          key("expert_shared_feed_forward_length")),
                      norm_topk_prob=True)
    else:
        config["intermediate_size"] = int(key("feed_forward_length"))
    return config


def _untile(x: mx.array, axis: int, config: dict[str, Any], head_dim: int) -> mx.array:
    """Value heads along ``axis`` from llama.cpp's tiled order back to grouped order."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    shape = list(x.shape)
    tiled = x.reshape(shape[:axis] + [nv // nk, nk, head_dim] + shape[axis + 1:])
    return mx.swapaxes(tiled, axis, axis + 1).reshape(shape)


def _bits(weights: dict[str, mx.array], name: str) -> int:
    packed = weights[f"{name}.weight"].shape[-1]
    return packed * 32 // (weights[f"{name}.scales"].shape[-1] * GROUP_SIZE)


def _rows(weights: dict[str, mx.array], name: str, config: dict[str, Any],
          head_dim: int, start: int = 0) -> None:
    """Untile rows ``start:`` of tensor ``name`` (and of its scales and biases)."""
    for part in ("weight", "scales", "biases", "bias"):
        full = f"{name}.{part}" if f"{name}.{part}" in weights else None
        if full is None:
            continue
        value = weights[full]
        if value.ndim == 1 and start == 0:
            weights[full] = _untile(value[:, None], 0, config, head_dim)[:, 0]
        else:
            weights[full] = mx.concatenate(
                [value[:start], _untile(value[start:], 0, config, head_dim)])


def _columns(weights: dict[str, mx.array], name: str, config: dict[str, Any],
             head_dim: int) -> None:
    """Untile the input columns of tensor ``name``."""
    weight = weights[f"{name}.weight"]
    if f"{name}.scales" not in weights:
        weights[f"{name}.weight"] = _untile(weight, 1, config, head_dim)
        return
    bits = _bits(weights, name)
    scales, biases = weights[f"{name}.scales"], weights[f"{name}.biases"]
    if head_dim % GROUP_SIZE == 0:  # whole groups move: exact
        per_word = 32 // bits
        weights[f"{name}.weight"] = _untile(weight, 1, config, head_dim // per_word)
        weights[f"{name}.scales"] = _untile(scales, 1, config, head_dim // GROUP_SIZE)
        weights[f"{name}.biases"] = _untile(biases, 1, config, head_dim // GROUP_SIZE)
        return
    # A head narrower than a group splits groups: the layer stays dequantized (exact;
    # requantizing mixed halves of two groups would add error llama.cpp does not have).
    dense = mx.dequantize(weight, scales, biases, group_size=GROUP_SIZE, bits=bits)
    weights[f"{name}.weight"] = _untile(dense, 1, config, head_dim)
    del weights[f"{name}.scales"], weights[f"{name}.biases"]


def qwen35_weights(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """The GGUF's tensors under mlx-lm's qwen3_5 names, llama.cpp's steps undone."""
    layers = config["num_hidden_layers"]
    weights = {name: value for name, value in weights.items()
               if not name.startswith("blk.") or int(name.split(".")[1]) < layers}
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    qk = 2 * dk * config["linear_num_key_heads"]
    reorder = config["linear_num_key_heads"] != config["linear_num_value_heads"]
    for i in range(layers):
        blk = f"blk.{i}"
        if f"{blk}.ssm_a" not in weights:
            continue
        weights[f"{blk}.ssm_a"] = mx.log(-weights[f"{blk}.ssm_a"].astype(mx.float32))
        if reorder:
            _rows(weights, f"{blk}.attn_qkv", config, dv, start=qk)
            _rows(weights, f"{blk}.attn_gate", config, dv)
            _rows(weights, f"{blk}.ssm_beta", config, 1)
            _rows(weights, f"{blk}.ssm_alpha", config, 1)
            _rows(weights, f"{blk}.ssm_dt", config, 1)
            weights[f"{blk}.ssm_a"] = _untile(weights[f"{blk}.ssm_a"][:, None], 0, config,
                                              1)[:, 0]
            _rows(weights, f"{blk}.ssm_conv1d", config, dv, start=qk)
            _columns(weights, f"{blk}.ssm_out", config, dv)
        conv = weights[f"{blk}.ssm_conv1d.weight"]
        weights[f"{blk}.ssm_conv1d.weight"] = conv[:, :, None]  # (channels, kernel, 1)
    renamed: dict[str, mx.array] = {}
    for name, value in weights.items():
        renamed[_mlx_name(name)] = value
    return renamed


def _mlx_name(name: str) -> str:
    pre = "language_model."
    if name.startswith("token_embd."):
        return pre + "model.embed_tokens." + name.split(".", 1)[1]
    if name.startswith("output_norm."):
        return pre + "model.norm." + name.split(".", 1)[1]
    if name.startswith("output."):
        return pre + "lm_head." + name.split(".", 1)[1]
    _, layer, kind, *leaf = name.split(".")
    layer_pre = f"{pre}model.layers.{layer}."
    if kind == "ssm_a":
        return layer_pre + "linear_attn.A_log"
    if kind == "ssm_dt":
        return layer_pre + "linear_attn.dt_bias"
    if kind in _LAYER:
        return f"{layer_pre}{_LAYER[kind]}.{'.'.join(leaf)}"
    return name
