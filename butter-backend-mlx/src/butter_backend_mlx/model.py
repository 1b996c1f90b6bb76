"""A loaded MLX checkpoint: the network, its vocabulary and what the core needs to know."""

from __future__ import annotations

import json
from collections.abc import Mapping

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from tokenizers import Tokenizer

from butter.backend import KVSpec, ModelInfo
from butter_backend_mlx.checkpoint import Checkpoint
from butter_backend_mlx.runtime import MLXRuntime

# Control tokens llama.cpp also ends a generation on, by their text.
END_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
                       "<|end_of_text|>"})


def _bytes_of_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF = _bytes_of_unicode()


class MLXModel:
    """An mlx-lm network and its tokenizer; runtimes run it on the engine thread."""

    def __init__(self, checkpoint: Checkpoint, *, description: str) -> None:
        self.network = checkpoint.model
        self.mtp = checkpoint.mtp  # the draft head mlx-lm drops (mtp.py), or None
        self.config = checkpoint.config
        self._tokenizer = checkpoint.tokenizer
        # The same vocabulary without added tokens: client text never becomes a special one.
        self._plain = _without_added_tokens(checkpoint.tokenizer)
        self._bos = checkpoint.bos_id
        self._add_bos = checkpoint.add_bos
        self._control = checkpoint.control_ids
        vocab = checkpoint.tokenizer
        self._end = frozenset(checkpoint.eos_ids) | {
            i for i in checkpoint.control_ids if vocab.id_to_token(i) in END_TEXTS}
        self._pieces: dict[int, bytes] = {}
        caches = make_prompt_cache(self.network)
        self.cache_kinds = {type(c).__name__ for c in caches}
        # Layers that keep keys and values per token; a hybrid's recurrent layers
        # (ArraysCache: Gated DeltaNet, short convolutions) keep a fixed-size state instead.
        self._kv_layers = sum(1 for c in caches if not isinstance(c, ArraysCache))
        attention_only = all(type(c) is KVCache for c in caches)
        windowed = any(isinstance(c, RotatingKVCache) for c in caches)
        self.info = ModelInfo(
            architecture=str(self.config.get("model_type", "unknown")),
            n_ctx_train=int(self.config.get("max_position_embeddings") or 4096),
            chat_template=checkpoint.chat_template,
            bos_token=vocab.id_to_token(self._bos) or "" if self._bos is not None else "",
            eos_token=vocab.id_to_token(min(checkpoint.eos_ids)) or ""
            if checkpoint.eos_ids else "",
            add_bos=self._add_bos,
            can_rewind=attention_only and not windowed,
            # Hybrids too: ArraysCache rows merge, extend, filter and extract as
            # BatchKVCache's do, so recurrent sessions share passes.
            fusable=all(type(c) in (KVCache, ArraysCache) for c in caches),
            description=description,
            control_tokens=tuple(t for i in sorted(self._control)
                                 if (t := vocab.id_to_token(i))),
            n_vocab=int(self.config.get("vocab_size") or vocab.get_vocab_size()),
            fim_tokens=_fim_tokens(vocab),
            draft_head=self.mtp is not None,
        )

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tokenizer = self._tokenizer if parse_special else self._plain
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos and self._bos is not None:
            ids.insert(0, self._bos)
        return ids

    def token_piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            text = self._tokenizer.id_to_token(token) or ""
            if token in self._control:
                piece = b""  # as llama.cpp renders control tokens: nothing
            elif all(ch in _BYTE_OF for ch in text):
                piece = bytes(_BYTE_OF[ch] for ch in text)
            else:  # an added token stored as plain text
                piece = text.encode("utf-8")
            self._pieces[token] = piece
        return piece

    def is_end_of_generation(self, token: int) -> bool:
        return token in self._end

    def kv_shape(self) -> tuple[int, int, int]:
        """Layers that cache keys and values, their key/value heads and head dimension."""
        config = self.config
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        return self._kv_layers, kv_heads, head_dim

    def kv_token_bytes(self) -> int:
        """Bytes one token's keys and values take across every layer (raw, in the
        activations' dtype)."""
        layers, kv_heads, head_dim = self.kv_shape()
        return layers * 2 * kv_heads * head_dim * self.activation_dtype.size

    @property
    def activation_dtype(self) -> mx.Dtype:
        embed = self.network.model.embed_tokens if hasattr(self.network, "model") else None
        scales = getattr(embed, "scales", None)
        weight = scales if scales is not None else getattr(embed, "weight", None)
        return weight.dtype if weight is not None else mx.float16

    def create_runtime(self, *, kv: KVSpec, capacity: int, n_sessions: int, max_batch: int,
                       options: Mapping[str, object]) -> MLXRuntime:
        return MLXRuntime(self, kv=kv, capacity=capacity, n_sessions=n_sessions,
                          max_batch=max_batch, options=options)

    def close(self) -> None:
        self.network = None
        self._pieces.clear()
        mx.clear_cache()


def _without_added_tokens(tokenizer: Tokenizer) -> Tokenizer:
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(data))


# Fill-in-the-middle token spellings: StarCoder / SantaCoder, then Qwen / DeepSeek style.
FIM_SPELLINGS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                 ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def _fim_tokens(vocab) -> tuple[int, int, int] | None:
    for names in FIM_SPELLINGS:
        ids = [vocab.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return tuple(ids)
    return None
