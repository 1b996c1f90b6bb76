"""An HF Qwen3.5 folder to GGUF, step for step as the pinned ``convert_hf_to_gguf.py``.

The pinned converter (``conversion/qwen.py``: ``Qwen3_5TextModel`` /
``Qwen3_5MoeTextModel`` over ``_LinearAttentionVReorderBase``, ``Qwen3NextModel``,
``Qwen2MoeModel`` and ``TextModel``) imports torch; this module does the same tensor
transformations in numpy and writes with the pinned ``gguf-py``:

- names lose ``language_model.``; ``mtp.*`` tensors are left out (as ``--no-mtp``);
- linear-attention value heads go from grouped-by-key-head to tiled order (rows of the V
  part of ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a/b``, ``A_log``, ``dt_bias``, the V
  channels of ``conv1d``, columns of ``out_proj``);
- ``A_log`` becomes ``ssm_a = -exp(A_log)``; ``dt_bias`` becomes ``ssm_dt.bias``;
  ``conv1d`` is squeezed; every RMSNorm weight but ``linear_attn.norm`` gets ``+ 1``;
- fused ``experts.gate_up_proj`` splits into gate and up; ``experts.down_proj`` keeps shape;
- 1-D tensors, norms, the router, the shared-expert gate and ``conv1d`` stay F32, other
  weights F16; the metadata is the converter's (SSM sizes, recurrent layers, rotary
  dimension count, M-RoPE sections, expert sizes).

Quantized copies come from llama.cpp's own ``llama_model_quantize`` (``llama-quantize``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from support.tiny_qwen35 import gguf_py, read_safetensors, template_text, vocabulary

_F32_TENSORS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "SSM_CONV1D")


def _reorder_v_heads(tensor: np.ndarray, dim: int, num_k_heads: int, num_v_per_k: int,
                     head_dim: int) -> np.ndarray:
    """Value heads from grouped (by key head) to tiled order along ``dim``."""
    shape = list(tensor.shape)
    dim %= len(shape)
    grouped = tensor.reshape(shape[:dim] + [num_k_heads, num_v_per_k, head_dim]
                             + shape[dim + 1:])
    return np.swapaxes(grouped, dim, dim + 1).reshape(shape)


def _reorder_linear_attention(name: str, data: np.ndarray,
                              hp: dict[str, Any]) -> np.ndarray:
    """``_LinearAttentionVReorderBase.modify_tensors``."""
    nk, nv = hp.get("linear_num_key_heads", 0), hp.get("linear_num_value_heads", 0)
    if not (nk > 0 and nv > 0 and nk != nv and "linear_attn." in name):
        return data
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    per_k = nv // nk
    qk = 2 * dk * nk
    if ".in_proj_qkv." in name:
        return np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, nk, per_k, dv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(data, 0, nk, per_k, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(data, 0, nk, per_k, 1)
    if ".A_log" in name or ".dt_bias" in name or ".dt_proj" in name:
        if data.ndim == 1:
            return _reorder_v_heads(data[:, None], 0, nk, per_k, 1)[:, 0]
        return _reorder_v_heads(data, -1, nk, per_k, 1)
    if ".conv1d" in name:
        squeezed = data.squeeze()
        return np.concatenate([squeezed[:qk],
                               _reorder_v_heads(squeezed[qk:], 0, nk, per_k, dv)])
    if ".out_proj." in name:
        return _reorder_v_heads(data, 1, nk, per_k, dv)
    return data


def _modify(name: str, data: np.ndarray, hp: dict[str, Any]):
    """``Qwen3NextModel`` then ``Qwen2MoeModel.modify_tensors``: (HF name, data) pairs
    ready for the tensor-name map."""
    data = _reorder_linear_attention(name, data, hp)
    if name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1
    if name.endswith("mlp.experts.down_proj"):
        yield name + ".weight", data
    elif name.endswith("mlp.experts.gate_up_proj"):
        inner = data.shape[-2] // 2
        base = name.removesuffix(".gate_up_proj")
        yield f"{base}.gate_proj.weight", data[..., :inner, :]
        yield f"{base}.up_proj.weight", data[..., inner:, :]
    else:
        yield name, data


def _metadata(writer, hp: dict[str, Any], gguf) -> None:
    """``TextModel`` / ``Qwen2MoeModel`` / ``Qwen3NextModel.set_gguf_parameters``."""
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    if "intermediate_size" in hp:
        writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    rope = dict(hp["rope_parameters"])
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    writer.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if "num_experts" in hp:
        writer.add_expert_count(hp["num_experts"])
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if "moe_intermediate_size" in hp:
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in hp:
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hp["linear_key_head_dim"])
    writer.add_ssm_group_count(hp["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if (layer_types := hp.get("layer_types")) is not None:
        writer.add_recurrent_layers([t == "linear_attention" for t in layer_types])
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))


def _vocab(writer, folder: Path, gguf) -> None:
    """``_set_vocab_gpt2``: the vocabulary, its types, merges and special ids."""
    tokens, types, merges = vocabulary()
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {text: index for index, text in enumerate(tokens)}
    writer.add_eos_token_id(ids[settings["eos_token"]])
    writer.add_pad_token_id(ids[settings["pad_token"]])
    writer.add_bos_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    template = settings.get("chat_template")
    writer.add_chat_template(template if template is not None else template_text())


def _qtype(new_name: str, data: np.ndarray, bid: int | None, gguf):
    """``prepare_tensors``' choice of storage type."""
    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    if data.ndim <= 1 or new_name.endswith("_norm.weight"):
        return F32
    if not new_name.endswith(".weight"):
        return F32
    for key in _F32_TENSORS:
        template = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, key)]
        if new_name == template.format(bid=bid) + ".weight":
            return F32
    return F16


def convert_folder(folder: Path, dest: Path) -> Path:
    """Write the HF Qwen3.5 / Qwen3.5-MoE ``folder`` as an F16 GGUF at ``dest``."""
    gguf = gguf_py()
    folder, dest = Path(folder), Path(dest)
    config = json.loads((folder / "config.json").read_text())
    hp = {**config, **config.get("text_config", {})}
    arch = (gguf.MODEL_ARCH.QWEN35MOE if "Moe" in config["architectures"][0]
            else gguf.MODEL_ARCH.QWEN35)
    tensor_map = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(dest), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("Tiny Qwen3.5 MoE" if arch == gguf.MODEL_ARCH.QWEN35MOE
                    else "Tiny Qwen3.5")
    _metadata(writer, hp, gguf)
    _vocab(writer, folder, gguf)
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(read_safetensors(path))
    for hf_name in sorted(tensors):
        name = hf_name.replace("language_model.", "")
        if name.startswith(("mtp.", "model.mtp.")) or "visual." in name:
            continue
        bid = next((int(part) for part in name.split(".") if part.isdecimal()), None)
        for new_hf, data in _modify(name, tensors[hf_name], hp):
            new_name = tensor_map.get_name(new_hf, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise ValueError(f"cannot map tensor {new_hf!r}")
            qtype = _qtype(new_name, data, bid, gguf)
            array = np.ascontiguousarray(
                data, dtype=np.float32 if qtype == gguf.GGMLQuantizationType.F32
                else np.float16)
            writer.add_tensor(new_name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def quantize(source: Path, dest: Path, quant: str) -> Path:
    """``llama-quantize source dest quant`` through llama.cpp's C API."""
    import ctypes

    import llama_cpp

    ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
             "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[quant]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(),
                                            ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {quant} failed ({status})")
    return dest
