"""Checkpoints into mlx-lm model classes: a GGUF file through ``mx.load``, or a folder.

A GGUF's Q4_0, Q4_1 and Q8_0 tensors arrive from ``mx.load`` as MLX affine-quantized
weights (group size 32, scales and biases), each tensor with its own bits; the model is
built from mlx-lm's classes with the HF config the GGUF metadata describes. llama.cpp
stores a llama-family model's Q and K rows permuted for its interleaved RoPE, which is
MLX's ``traditional`` RoPE: the weights are used as stored with ``rope_traditional``.
The tokenizer is rebuilt from the GGUF vocabulary with ``tokenizers``.

A folder (``config.json`` plus safetensors, an HF or ``mlx-community`` checkpoint)
loads through ``mlx_lm.utils.load_model``, with ``tokenizer.json`` and the chat template
from ``tokenizer_config.json``. :func:`gguf_to_folder` writes such a folder from a GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, infer_quant_config, load_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from butter.errors import ModelLoadError
from butter_backend_mlx.mtp import load_head
from butter_backend_mlx.qwen35_gguf import ARCHITECTURES as QWEN35_ARCHITECTURES
from butter_backend_mlx.qwen35_gguf import qwen35_config, qwen35_weights

GROUP_SIZE = 32  # ggml's Q4_0 / Q4_1 / Q8_0 blocks
# ggml types mx.load turns into MLX arrays: F32, F16, Q4_0, Q4_1, Q8_0, BF16.
MLX_GGUF_TYPES = frozenset({0, 1, 2, 3, 8, 30})
ARCHITECTURES = frozenset({"llama", *QWEN35_ARCHITECTURES})
TOKENIZER_MODELS = frozenset({"gpt2"})
CONTROL, USER_DEFINED = 3, 4  # llama_token_type
# tokenizer.ggml.pre → the regex llama.cpp splits with before byte-level BPE.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DIGITS_FIRST = frozenset({"smollm", "starcoder", "refact"})
# Pre-tokenizers with their own split (as their tokenizer.json spells it; llama.cpp's
# QWEN2 / QWEN35 pre types).
SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
              r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@attrs.frozen
class Checkpoint:
    """What a loaded checkpoint gives the back end."""

    model: nn.Module
    config: dict[str, Any]
    tokenizer: Tokenizer
    chat_template: str | None
    bos_id: int | None
    eos_ids: frozenset[int]
    add_bos: bool
    control_ids: frozenset[int]
    mtp: nn.Module | None = None  # Qwen3.5's multi-token-prediction head (mtp.py)


def _scalar(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.size == 1 and value.ndim == 0 else value.tolist()
    return value


def load_gguf(path: Path, model_id: str) -> Checkpoint:
    weights, meta = mx.load(str(path), return_metadata=True)
    meta = {key: _scalar(value) for key, value in meta.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(model_id, f"the MLX back end reads {sorted(ARCHITECTURES)} GGUFs, "
                             f"not {arch!r}")
    if arch in QWEN35_ARCHITECTURES:
        config = qwen35_config(meta, arch, tied="output.weight" not in weights,
                               model_id=model_id)
        weights = qwen35_weights(weights, config)
    else:
        config = gguf_config(meta, arch)
        weights = {_hf_name(name): value for name, value in weights.items()}
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _quantize_like(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    _float32_experts_on_cpu(model)
    tokenizer, control = gguf_tokenizer(meta, model_id)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    return Checkpoint(
        model=model, config=config, tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=frozenset(int(t) for t in (eos, eot) if t is not None),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        control_ids=control,
    )


def gguf_config(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The HF ``config.json`` of a llama-family GGUF."""
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    return {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        # llama.cpp's converter permuted Q and K for interleaved (traditional) RoPE.
        "rope_traditional": True,
        "tie_word_embeddings": True,
    }


def _hf_name(name: str) -> str:
    if name.startswith("token_embd."):
        return "model.embed_tokens." + name.split(".", 1)[1]
    if name.startswith("output_norm."):
        return "model.norm." + name.split(".", 1)[1]
    if name.startswith("output."):
        return "lm_head." + name.split(".", 1)[1]
    if name.startswith("blk."):
        _, layer, kind, leaf = name.split(".", 3)
        if kind in _NAMES:
            return f"model.layers.{layer}.{_NAMES[kind]}.{leaf}"
    return name


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Quantize each layer that arrived quantized, with that tensor's own bits."""

    def predicate(path: str, module: nn.Module) -> dict | bool:
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=GROUP_SIZE, bits=4, class_predicate=predicate)


def gguf_tokenizer(meta: dict[str, Any], model_id: str) -> tuple[Tokenizer, frozenset[int]]:
    """A byte-level BPE ``tokenizers.Tokenizer`` from a GGUF's vocabulary, and its control ids."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ModelLoadError(model_id, f"the MLX back end reads byte-level BPE vocabularies "
                             f"(gpt2) from GGUF, not {kind!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pattern = SPLITS.get(meta.get("tokenizer.ggml.pre"), GPT2_SPLIT)
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    steps = [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if meta.get("tokenizer.ggml.pre") in DIGITS_FIRST:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    control = frozenset(i for i, t in enumerate(types) if t == CONTROL)
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tokenizer.add_tokens(added)
    return tokenizer, control


def text_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A folder's ``config.json`` with the text model's settings at the top level.

    Multimodal checkpoints (Qwen3.5's ``Qwen3_5ForConditionalGeneration``, Gemma 3, ...)
    nest them under ``text_config``; the top level's own keys (``model_type``,
    ``architectures``) still win, so the architecture is the checkpoint's.
    """
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return {**text, **{key: value for key, value in config.items() if key != "text_config"}}


def load_folder(path: Path, model_id: str) -> Checkpoint:
    try:
        model, raw_config = load_model(path)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelLoadError(model_id, f"mlx-lm could not build it ({_short(exc)})") from None
    config = text_settings(raw_config)
    _float32_experts_on_cpu(model)
    mtp = load_head(path, model, raw_config, model_id)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(model_id, "the folder has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    settings: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        settings = json.loads((path / "tokenizer_config.json").read_text())
    template = settings.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    control = frozenset(
        index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special
    )
    bos = _token_id(tokenizer, settings.get("bos_token"))
    eos_setting = config.get("eos_token_id", _token_id(tokenizer, settings.get("eos_token")))
    eos = eos_setting if isinstance(eos_setting, list) else [eos_setting]
    # generation_config.json names every id a generation ends on (Qwen: <|im_end|> too).
    generation = _json_file(path / "generation_config.json").get("eos_token_id")
    eos += generation if isinstance(generation, list) else [generation]
    return Checkpoint(
        model=model, config=config, tokenizer=tokenizer, chat_template=template,
        bos_id=bos, eos_ids=frozenset(int(t) for t in eos if t is not None),
        add_bos=bool(settings.get("add_bos_token", False)), control_ids=control, mtp=mtp,
    )


def _float32_experts_on_cpu(model: nn.Module) -> None:
    """MLX's CPU ``gather_mm`` multiplies float32 only, so a mixture-of-experts model
    with unquantized bfloat16 or float16 experts (an HF Qwen3.5-MoE, say) cannot run a
    step on CPU. Such a model runs in float32 there: all of it, so activations, caches
    and the bytes admission counts keep one dtype. Quantized experts (``gather_qmm``)
    keep their dtype."""
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu:
        return
    if any(isinstance(module, SwitchLinear) and module.weight.dtype != mx.float32
           for _, module in model.named_modules()):
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object file, or ``{}`` when it is absent or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_id(tokenizer: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _short(exc: Exception) -> str:
    """An exception's first line without filesystem paths (it reaches clients)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return " ".join(word for word in text.split() if "/" not in word)


def gguf_to_folder(gguf: Path, folder: Path) -> Path:
    """Write ``folder`` as an MLX checkpoint (config, safetensors, tokenizer) of ``gguf``."""
    checkpoint = load_gguf(gguf, str(gguf))
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(checkpoint.model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": 4}
    for name, module in checkpoint.model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            quantization[name] = {"group_size": module.group_size, "bits": module.bits}
    config = dict(checkpoint.config, quantization=quantization,
                  eos_token_id=sorted(checkpoint.eos_ids))
    if checkpoint.bos_id is not None:
        config["bos_token_id"] = checkpoint.bos_id
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    checkpoint.tokenizer.save(str(folder / "tokenizer.json"))
    vocab = checkpoint.tokenizer
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": checkpoint.chat_template,
        "add_bos_token": checkpoint.add_bos,
        "bos_token": vocab.id_to_token(checkpoint.bos_id) if checkpoint.bos_id is not None
        else None,
        "eos_token": vocab.id_to_token(min(checkpoint.eos_ids)) if checkpoint.eos_ids
        else None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder
