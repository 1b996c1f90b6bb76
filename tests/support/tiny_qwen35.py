"""Tiny random-weight Qwen3.5 checkpoints in the real layout, as an HF folder and as GGUF.

The architecture is Qwen3.5's own, only small: four layers in the hybrid pattern (three
Gated DeltaNet linear-attention layers, then one full-attention layer; the interval is 4),
hidden size 64, more linear-attention value heads than key heads (so the converter's
value-head reordering matters), gated full attention (``q_proj`` carries the output gate)
and partial rotary embeddings (a quarter of each head). ``moe=True`` builds a
``qwen3_5_moe`` instead: every layer's MLP is four routed experts (two per token, fused
``gate_up_proj`` as the real checkpoints store them) plus a gated shared expert.
``mtp=True`` adds Qwen3.5's multi-token-prediction head (``mtp_num_hidden_layers: 1``)
as the real checkpoints carry it, under top-level ``mtp.*`` names: ``mtp.fc`` over the
normed embedding and hidden state (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``),
one full-attention decoder layer ``mtp.layers.0.*`` and ``mtp.norm``.

The vocabulary is the real one: the pinned llama.cpp's ``ggml-vocab-qwen35.gguf``
(Qwen2's 151,936 ids, Qwen3.5's pre-tokenizer), with Qwen3's added tokens (``<think>``,
``<tool_call>``, ...) placed at their Qwen3 ids. The template is the real
``Qwen3.5-4B.jinja``. Both come from the pinned llama-cpp-python sdist, found through
``BUTTER_LLAMA_SDIST`` (``scripts/test.sh`` downloads it and sets it).

The HF folder is what ``Qwen/Qwen3.5-*`` ships: a ``Qwen3_5ForConditionalGeneration``
``config.json`` (text settings under ``text_config``), bfloat16 safetensors named
``model.language_model.*`` with Qwen3.5's zero-centred RMSNorm weights, ``tokenizer.json``
(no normalizer: Qwen3.5 does not NFC-normalize), ``tokenizer_config.json`` and
``chat_template.jinja``. :func:`build_gguf` converts that folder the way the pinned
``convert_hf_to_gguf.py`` does for ``Qwen3_5ForConditionalGeneration`` (the script itself
needs torch; the same steps run here in numpy, written with the pinned ``gguf-py``), then
quantizes with llama.cpp's own ``llama_model_quantize`` for the Q8_0 and Q4_0 copies.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

SDIST_ENV = "BUTTER_LLAMA_SDIST"
SDIST_NAME = "llama_cpp_python-0.3.36"
# Where scripts/test.sh unpacks the sdist when BUTTER_LLAMA_SDIST is not set.
DEFAULT_SDIST = Path(__file__).resolve().parents[2] / ".cache" / "llama-sdist" / SDIST_NAME
SEED = 35
QUANTS = ("F16", "Q8_0", "Q4_0")

# Qwen3's added tokens at their Qwen3 ids (tokenizer_config.json's added_tokens_decoder):
# (id, text, special). <tool_call>, <think> and the rest are added but not special.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True), (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True), (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True), (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True), (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False), (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False), (151666, "</tool_response>", False),
    (151667, "<think>", False), (151668, "</think>", False),
)
ENDOFTEXT, IM_END = 151643, 151645
# Qwen3.5's pre-tokenizer regex as its tokenizer.json spells it (llama.cpp's QWEN35 type).
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

HIDDEN = 64
LAYERS = 4
INTERVAL = 4


def sdist_root() -> Path:
    """The unpacked pinned llama-cpp-python sdist: ``$BUTTER_LLAMA_SDIST``, else the
    folder ``scripts/test.sh`` fills. Raises ``FileNotFoundError`` naming both."""
    configured = os.environ.get(SDIST_ENV)
    root = Path(configured) if configured else DEFAULT_SDIST
    if not (root / "vendor" / "llama.cpp" / "gguf-py").is_dir():
        raise FileNotFoundError(
            f"the pinned llama-cpp-python sdist is not at {root} (set {SDIST_ENV} to an "
            f"unpacked {SDIST_NAME}, or run scripts/test.sh, which downloads it)")
    return root


def llama_cpp_dir() -> Path:
    return sdist_root() / "vendor" / "llama.cpp"


def vocab_path() -> Path:
    return llama_cpp_dir() / "models" / "ggml-vocab-qwen35.gguf"


def template_text() -> str:
    return (llama_cpp_dir() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()


def gguf_py():
    """The pinned ``gguf-py`` (it knows the qwen35 architectures; PyPI's may not)."""
    path = str(llama_cpp_dir() / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    if not hasattr(gguf.MODEL_ARCH, "QWEN35"):
        raise ImportError(f"gguf imported from {gguf.__file__} has no QWEN35 architecture")
    return gguf


# --- configuration ------------------------------------------------------------------------


def text_config(*, moe: bool, mtp: bool = False) -> dict[str, Any]:
    """``text_config`` of the tiny model, with the fields the real Qwen3.5 configs carry."""
    layer_types = ["linear_attention" if (i + 1) % INTERVAL else "full_attention"
                   for i in range(LAYERS)]
    config: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": 151936,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": INTERVAL,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            # head_dim 32 x 0.25 = 8 rotary dims: 4 frequency pairs over (t, h, w).
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "bfloat16",
        "eos_token_id": ENDOFTEXT,
        "bos_token_id": None,
    }
    if moe:
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, router_aux_loss_coef=0.001,
                      output_router_logits=False)
    else:
        config["intermediate_size"] = 128
    return config


def hf_config(*, moe: bool, mtp: bool = False) -> dict[str, Any]:
    """The folder's ``config.json``: a ``Qwen3_5(Moe)ForConditionalGeneration`` config."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_config(moe=moe, mtp=mtp),
        "tie_word_embeddings": True,
        "transformers_version": "5.0.0",
    }


# --- weights ------------------------------------------------------------------------------


def _bf16_round(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bfloat16 (nearest even), kept as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def hf_weights(*, moe: bool, seed: int = SEED) -> dict[str, np.ndarray]:
    """Random weights under their HF names (float32 holding bfloat16 values).

    Scales keep activations near unit size, and the tied embedding is wide enough that
    logits are peaked: greedy decoding does not hang on near-ties between back ends.
    """
    cfg = text_config(moe=moe)
    rng = np.random.default_rng(seed)
    hidden = cfg["hidden_size"]

    def dense(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, cols ** -0.5, (rows, cols))

    def centred(size: int) -> np.ndarray:  # Qwen3.5 RMSNorm weights are stored as w - 1
        return rng.normal(0.0, 0.1, size)

    pre = "model.language_model."
    weights: dict[str, np.ndarray] = {
        pre + "embed_tokens.weight": rng.normal(0.0, 0.5, (cfg["vocab_size"], hidden)),
        pre + "norm.weight": centred(hidden),
    }
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    heads, kv_heads, head_dim = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                 cfg["head_dim"])
    for i, kind in enumerate(cfg["layer_types"]):
        layer = f"{pre}layers.{i}."
        weights[layer + "input_layernorm.weight"] = centred(hidden)
        weights[layer + "post_attention_layernorm.weight"] = centred(hidden)
        if kind == "linear_attention":
            attn = layer + "linear_attn."
            weights[attn + "in_proj_qkv.weight"] = dense(conv_dim, hidden)
            weights[attn + "in_proj_z.weight"] = dense(value_dim, hidden)
            weights[attn + "in_proj_b.weight"] = dense(nv, hidden)
            weights[attn + "in_proj_a.weight"] = dense(nv, hidden)
            weights[attn + "conv1d.weight"] = rng.normal(
                0.0, 0.5, (conv_dim, 1, cfg["linear_conv_kernel_dim"]))
            weights[attn + "dt_bias"] = rng.uniform(0.0, 1.0, nv)
            weights[attn + "A_log"] = np.log(rng.uniform(1.0, 16.0, nv))
            weights[attn + "norm.weight"] = 1.0 + rng.normal(0.0, 0.1, dv)
            weights[attn + "out_proj.weight"] = dense(hidden, value_dim)
        else:
            attn = layer + "self_attn."
            # Twice the query rows: each head's query, then its output gate.
            weights[attn + "q_proj.weight"] = dense(heads * head_dim * 2, hidden)
            weights[attn + "k_proj.weight"] = dense(kv_heads * head_dim, hidden)
            weights[attn + "v_proj.weight"] = dense(kv_heads * head_dim, hidden)
            weights[attn + "o_proj.weight"] = dense(hidden, heads * head_dim)
            weights[attn + "q_norm.weight"] = centred(head_dim)
            weights[attn + "k_norm.weight"] = centred(head_dim)
        mlp = layer + "mlp."
        if moe:
            experts, inner = cfg["num_experts"], cfg["moe_intermediate_size"]
            shared = cfg["shared_expert_intermediate_size"]
            # A decisive router: near-ties between the second and third expert would let
            # float16 rounding pick different experts on different back ends.
            weights[mlp + "gate.weight"] = 4 * dense(experts, hidden)
            weights[mlp + "experts.gate_up_proj"] = rng.normal(
                0.0, hidden ** -0.5, (experts, 2 * inner, hidden))
            weights[mlp + "experts.down_proj"] = rng.normal(
                0.0, inner ** -0.5, (experts, hidden, inner))
            weights[mlp + "shared_expert.gate_proj.weight"] = dense(shared, hidden)
            weights[mlp + "shared_expert.up_proj.weight"] = dense(shared, hidden)
            weights[mlp + "shared_expert.down_proj.weight"] = dense(hidden, shared)
            weights[mlp + "shared_expert_gate.weight"] = dense(1, hidden)
        else:
            inner = cfg["intermediate_size"]
            weights[mlp + "gate_proj.weight"] = dense(inner, hidden)
            weights[mlp + "up_proj.weight"] = dense(inner, hidden)
            weights[mlp + "down_proj.weight"] = dense(hidden, inner)
    return {name: _bf16_round(value) for name, value in weights.items()}


def mtp_weights(*, seed: int = SEED + 1, copies: bool = False) -> dict[str, np.ndarray]:
    """Random weights of the multi-token-prediction head under their HF names (``mtp.*``,
    top level, as Qwen3.5 checkpoints store them; norms zero-centred like the rest).

    ``copies``: a head that guesses the token it is given comes again (``fc`` passes the
    normed embedding through, the layer's output projections are zero, the norms are
    plain), so its drafts are accepted wherever the model repeats a token."""
    cfg = text_config(moe=False, mtp=True)
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim = (cfg["hidden_size"], cfg["num_attention_heads"],
                                         cfg["num_key_value_heads"], cfg["head_dim"])
    inner = cfg["intermediate_size"]

    def dense(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, cols ** -0.5, (rows, cols))

    def centred(size: int) -> np.ndarray:
        return rng.normal(0.0, 0.1, size)

    layer = "mtp.layers.0."
    weights = {
        "mtp.fc.weight": dense(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": centred(hidden),
        "mtp.pre_fc_norm_hidden.weight": centred(hidden),
        "mtp.norm.weight": centred(hidden),
        layer + "input_layernorm.weight": centred(hidden),
        layer + "post_attention_layernorm.weight": centred(hidden),
        layer + "self_attn.q_proj.weight": dense(heads * head_dim * 2, hidden),
        layer + "self_attn.k_proj.weight": dense(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": dense(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": dense(hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": centred(head_dim),
        layer + "self_attn.k_norm.weight": centred(head_dim),
        layer + "mlp.gate_proj.weight": dense(inner, hidden),
        layer + "mlp.up_proj.weight": dense(inner, hidden),
        layer + "mlp.down_proj.weight": dense(hidden, inner),
    }
    if copies:
        weights["mtp.fc.weight"] = np.eye(hidden, 2 * hidden)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            weights[layer + name] = np.zeros_like(weights[layer + name])
        for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):
            weights[name] = np.zeros(hidden)
    return {name: _bf16_round(value) for name, value in weights.items()}


# --- safetensors (bfloat16 needs no numpy dtype: written and read as raw bits) ------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], *,
                      keep_f32: tuple[str, ...] = ()) -> None:
    """Write ``tensors`` as bfloat16 safetensors (names ending in ``keep_f32`` as F32)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if name.endswith(keep_f32):
            dtype, blob = "F32", value.tobytes()
        else:
            dtype, blob = "BF16", (_bf16_round(value).view(np.uint32) >> 16).astype(
                "<u2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        for blob in blobs:
            out.write(blob)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (BF16, F16 and F32 are read)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    base = 8 + size
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        blob = data[base + start:base + end]
        if entry["dtype"] == "BF16":
            bits = np.frombuffer(blob, dtype="<u2").astype(np.uint32) << 16
            value = bits.view(np.float32)
        else:
            value = np.frombuffer(blob, dtype=_ST_DTYPES[entry["dtype"]]).astype(np.float32)
        tensors[name] = value.reshape(entry["shape"])
    return tensors


# --- tokenizer ----------------------------------------------------------------------------


def _read_gguf_kv(path: Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (strings, numbers and arrays of them).

    gguf-py's ``GGUFReader`` takes seconds over a 150k-token vocabulary; this reads it in
    a fraction of that.
    """
    data = path.read_bytes()
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        size = take("<Q")
        pos += size
        return data[pos - size:pos].decode("utf-8")

    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}

    def value(kind: int) -> Any:
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = take("<I"), take("<Q")
            return [value(inner) for _ in range(count)]
        return take(scalars[kind])

    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 8
    _tensors, count = take("<Q"), take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(count):
        key = string()
        meta[key] = value(take("<I"))
    return meta


@functools.lru_cache(maxsize=1)
def _vocab_file() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    meta = _read_gguf_kv(vocab_path())
    return (tuple(meta["tokenizer.ggml.tokens"]), tuple(meta["tokenizer.ggml.token_type"]),
            tuple(meta["tokenizer.ggml.merges"]))


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, llama.cpp token types and merges: the sdist's Qwen3.5 vocabulary with
    Qwen3's added tokens at their ids (control for special or ``<|...|>`` ones, as the
    converter marks them; user-defined for ``<think>``, ``<tool_call>`` and the rest)."""
    gguf = gguf_py()
    file_tokens, file_types, merges = _vocab_file()
    tokens, types = list(file_tokens), list(file_types)
    for index, text, special in ADDED_TOKENS:
        tokens[index] = text
        looks_special = text.startswith("<|") and text.endswith("|>")
        types[index] = int(gguf.TokenType.CONTROL if special or looks_special
                           else gguf.TokenType.USER_DEFINED)
    return tokens, types, list(merges)


def tokenizer_json(tokens: list[str], merges: list[str]) -> dict[str, Any]:
    """Qwen3.5's ``tokenizer.json``: byte-level BPE, its split regex, no normalizer."""
    first_added = ADDED_TOKENS[0][0]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": index, "content": text, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": special}
            for index, text, special in ADDED_TOKENS
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_SPLIT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False,
                           "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
            "byte_fallback": False, "ignore_merges": False,
            "vocab": {text: index for index, text in enumerate(tokens[:first_added])},
            "merges": merges,
        },
    }


def tokenizer_config(template: str) -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(index): {"content": text, "lstrip": False, "normalized": False,
                         "rstrip": False, "single_word": False, "special": special}
            for index, text, special in ADDED_TOKENS
        },
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# --- builders -----------------------------------------------------------------------------


def build_hf_folder(dest: Path, *, moe: bool = False, mtp: bool = False,
                    mtp_copies: bool = False) -> Path:
    """Write the tiny Qwen3.5 (or Qwen3.5-MoE) HF checkpoint into folder ``dest``; with
    ``mtp``, the dense model carries its multi-token-prediction head too (``mtp_copies``:
    the head of :func:`mtp_weights` ``copies=True``)."""
    if mtp and moe:
        raise ValueError("the tiny MTP head is a dense one")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    template = template_text()
    tokens, _, merges = vocabulary()
    (dest / "config.json").write_text(json.dumps(hf_config(moe=moe, mtp=mtp), indent=2))
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "do_sample": True,
         "temperature": 1.0, "top_k": 20, "top_p": 0.95}, indent=2))
    weights = hf_weights(moe=moe)
    if mtp:
        weights.update(mtp_weights(copies=mtp_copies))
    write_safetensors(dest / "model.safetensors", weights, keep_f32=("A_log",))
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer_json(tokens, merges),
                                                    ensure_ascii=False))
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(template),
                                                           indent=2, ensure_ascii=False))
    (dest / "chat_template.jinja").write_text(template)
    return dest


def build_gguf(dest: Path, *, moe: bool = False, quant: str = "F16",
               folder: Path | None = None) -> Path:
    """Write the tiny model as GGUF file ``dest`` (``quant``: F16, Q8_0 or Q4_0).

    Converts ``folder`` (an HF folder from :func:`build_hf_folder`), or builds one beside
    ``dest`` first.
    """
    from support.qwen35_gguf import convert_folder, quantize

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, not {quant!r}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if folder is None:
        folder = build_hf_folder(dest.parent / f"{dest.stem}-hf", moe=moe)
    if quant == "F16":
        return convert_folder(folder, dest)
    f16 = dest.with_name(f"{dest.stem}-F16.gguf")
    if not f16.exists():
        convert_folder(folder, f16)
    return quantize(f16, dest, quant)
