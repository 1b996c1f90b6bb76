"""Qwen3.5's multi-token-prediction (MTP) head: the ``mtp.*`` weights mlx-lm drops.

A Qwen3.5 checkpoint carries one extra full-attention decoder layer trained to predict
the token after next (``mtp_num_hidden_layers: 1``; llama.cpp converts it as the
``nextn`` layer, vLLM runs it as ``Qwen3_5MultiTokenPredictor``). For position ``t`` it
takes the main model's final hidden state there (after the final norm: what the output
head reads) and the embedding of token ``t + 1``, norms each (``pre_fc_norm_hidden``,
``pre_fc_norm_embedding``), projects their concatenation ``[embedding, hidden]`` with
``fc``, runs its decoder layer over its own KV cache, norms (``mtp.norm``) and reads the
shared output head: a guess at token ``t + 2``. mlx-lm's ``qwen3_5.sanitize`` drops
every ``mtp.`` tensor; :func:`load_head` reads them from the folder's safetensors and
builds the head from mlx-lm's own ``DecoderLayer`` (full attention).

:class:`HeadDrafts` keeps each session's head cache. The runtime records the hidden
states of every position it feeds (:meth:`HeadDrafts.record`); a position enters the
head's cache only once the token after it is certain, so a rejected draft never
reaches it and nothing there needs rolling back. :meth:`HeadDrafts.propose` feeds the
recorded positions with the tokens that followed them, the last one with the request's
last draw, and returns the head's most likely next token: one draft per verify.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

log = logging.getLogger("butter.mlx")

PREFIX = "mtp."
# The head's 1-D norm weights: Qwen3.5 stores RMSNorm weights as w - 1 (zero-centred).
CENTRED_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight",
                 "q_norm.weight", "k_norm.weight")
MAX_PENDING = 8192  # recorded positions a session keeps before the head reads them


class MTPHead(nn.Module):
    """The head's layers (mlx-lm's Qwen3.5 decoder layer, full attention)."""

    def __init__(self, args: Any, layers: int) -> None:
        from mlx_lm.models.qwen3_5 import DecoderLayer

        super().__init__()
        hidden = args.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        # A layer index whose (index + 1) is a multiple of the interval: full attention.
        full = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, full) for _ in range(layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: list) -> mx.array:
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                            self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=layer_cache)
        return self.norm(x)


def _text_model(network: nn.Module):
    """mlx-lm's Qwen3.5 text model inside ``network`` (``Model.language_model``), or None."""
    text = getattr(network, "language_model", None)
    if text is None or not type(network).__module__.startswith("mlx_lm.models.qwen3_5"):
        return None
    return text


def mtp_layers(config: dict[str, Any]) -> int:
    """``mtp_num_hidden_layers`` of a (nested) Qwen3.5 config, 0 when absent."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("mtp_num_hidden_layers", 0)
    return value if isinstance(value, int) and value > 0 else 0


def head_tensors(folder: Path) -> dict[str, mx.array]:
    """The ``mtp.*`` tensors of a folder's safetensors (``model.mtp.*`` read as ``mtp.*``),
    opening only the shards the index names for them."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({file for name, file in names.items() if _head_name(name)})
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    tensors: dict[str, mx.array] = {}
    for file in files:
        for name, value in mx.load(str(folder / file)).items():
            short = _head_name(name)
            if short:
                tensors[short] = value
    return tensors


def _head_name(name: str) -> str | None:
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    return name[len(PREFIX):] if name.startswith(PREFIX) else None


def load_head(folder: Path, network: nn.Module, config: dict[str, Any],
              model_id: str) -> MTPHead | None:
    """The MTP head of a Qwen3.5 folder, or None when its config names none, the folder
    holds no ``mtp.*`` tensors (an mlx-lm conversion has dropped them) or they are not a
    dense head's (logged: the model itself serves as before, without drafts)."""
    layers = mtp_layers(config)
    text = _text_model(network)
    if not layers or text is None:
        return None
    tensors = head_tensors(folder)
    if not tensors:
        return None
    if getattr(text.args, "num_experts", 0):
        log.warning("%s: its MTP head is a mixture of experts; butter drafts with dense "
                    "Qwen3.5 MTP heads only", model_id)
        return None
    head = MTPHead(text.args, layers)
    weights = {name: value + 1.0 if name.endswith(CENTRED_NORMS) and value.ndim == 1
               else value for name, value in tensors.items()}
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        log.warning("%s: its mtp.* tensors do not fit Qwen3.5's MTP head (%s)", model_id, exc)
        return None
    head.set_dtype(text.model.embed_tokens.weight.dtype)
    mx.eval(head.parameters())
    return head


def output_head(network: nn.Module):
    """The vocabulary projection of a Qwen3.5 network (tied: the embedding as linear)."""
    text = _text_model(network)
    if text.args.tie_word_embeddings:
        return text.model.embed_tokens.as_linear
    return text.lm_head


@attrs.define
class _Session:
    cache: list  # one KVCache per head layer
    entries: list[int] = attrs.field(factory=list)  # main positions in the cache, in order
    start: int = 0  # main position of the first recorded, not yet fed, hidden state
    hidden: list[mx.array] = attrs.field(factory=list)  # [n, H] pieces from ``start`` on
    tokens: list[int] = attrs.field(factory=list)  # the tokens at those positions
    last: tuple[int, ...] = ()  # the last proposal (again while nothing new arrived)

    @property
    def recorded(self) -> int:
        return len(self.tokens)


class HeadDrafts:
    """Every session's MTP cache and recorded hidden states (engine thread only)."""

    def __init__(self, head: MTPHead, network: nn.Module, n_sessions: int) -> None:
        self._head = head
        self._embed = _text_model(network).model.embed_tokens
        self._project = output_head(network)
        self._layers = len(head.layers)
        self._sessions = [self._fresh() for _ in range(n_sessions)]

    def _fresh(self) -> _Session:
        return _Session(cache=[KVCache() for _ in range(self._layers)])

    def record(self, session: int, start: int, tokens: list[int], hidden: mx.array) -> None:
        """The main model fed ``tokens`` at ``start``... and ``hidden`` ([n, H]) are its
        final hidden states there."""
        state = self._sessions[session]
        if start != state.start + state.recorded:  # a cut the runtime did not report
            self.cut(session, start)
        state.hidden.append(hidden)
        state.tokens.extend(tokens)
        if state.recorded > MAX_PENDING:  # the head reads none of them: keep the newest
            self._drop_oldest(state, state.recorded - MAX_PENDING)

    def _drop_oldest(self, state: _Session, count: int) -> None:
        joined = mx.concatenate(state.hidden, axis=0)[count:]
        state.hidden, state.tokens = [joined], state.tokens[count:]
        state.start += count

    def propose(self, session: int, token: int) -> tuple[int, ...]:
        """The head's guess at the token after ``token`` (the session's last draw, not
        yet fed): the recorded positions enter the head's cache first."""
        state = self._sessions[session]
        if not state.recorded:
            return state.last
        hidden = mx.concatenate(state.hidden, axis=0)[None]
        following = mx.array([[*state.tokens[1:], token]])
        out = self._head(hidden, self._embed(following).astype(hidden.dtype), state.cache)
        logits = self._project(out[:, -1, :])
        draft = int(mx.argmax(logits[0]).item())
        state.entries.extend(range(state.start, state.start + state.recorded))
        state.start += state.recorded
        state.hidden, state.tokens = [], []
        state.last = (draft,)
        return state.last

    def cut(self, session: int, keep: int) -> None:
        """The session keeps its first ``keep`` positions: an entry stays only while the
        token after it (at most position ``keep - 1``) stays too."""
        state = self._sessions[session]
        state.last = ()
        if keep <= 0:
            self._sessions[session] = self._fresh()
            return
        if keep < state.start + state.recorded:
            kept = max(keep - state.start, 0)
            if kept:
                joined = mx.concatenate(state.hidden, axis=0)[:kept]
                state.hidden, state.tokens = [joined], state.tokens[:kept]
            else:
                state.hidden, state.tokens = [], []
        stale = sum(1 for at in state.entries if at >= keep - 1)
        if stale:
            for cache in state.cache:
                cache.trim(stale)
            del state.entries[len(state.entries) - stale:]
        if not state.recorded:
            # Position keep - 1's hidden state is gone with its entry: the head's context
            # skips it (drafts only, which verifies check).
            state.start = keep

    def fork(self, source: int, target: int, length: int) -> None:
        """``target`` takes ``source``'s first ``length`` positions."""
        src = self._sessions[source]
        copy = self._fresh()
        entries = [at for at in src.entries if at < length - 1]
        for mine, theirs in zip(copy.cache, src.cache):
            if entries:
                n = len(entries)
                mine.keys = mx.array(theirs.keys[..., :n, :])
                mine.values = mx.array(theirs.values[..., :n, :])
                mine.offset = n
        copy.entries = entries
        copy.start = src.start
        if src.recorded and length > src.start:
            kept = min(length - src.start, src.recorded)
            copy.hidden = [mx.concatenate(src.hidden, axis=0)[:kept]]
            copy.tokens = src.tokens[:kept]
        else:
            copy.start = length
        self._sessions[target] = copy
