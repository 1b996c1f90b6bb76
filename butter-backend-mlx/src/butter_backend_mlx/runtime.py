"""The MLX runtime: one mlx-lm cache per session, decode rows fused in a batched cache.

Each session holds its own per-layer caches: mlx-lm's ``make_prompt_cache`` for raw
float16, :class:`~butter_backend_mlx.kvcache.CodecKVCache` for a quantized codec (same
operations). Sessions that decode together live in one persistent left-padded batched
cache per layer (``BatchKVCache`` or a many-row ``CodecKVCache``): a
session joins it by ``merge`` + ``extend`` when its decoding starts and leaves it by
``extract`` + ``filter`` when it stops, so a steady batch costs one model call per
step and no copies. Prefill chunks of equal length run as one merged pass too.
Every item samples with its own random key, so a seed means the same alone or fused.
Only the engine thread calls into this object (one thread owns every MLX array).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from butter.backend import (
    ForkKind,
    KVFacts,
    KVSpec,
    PromptTail,
    SamplingParams,
    StepFailedError,
    TruncateKind,
    Work,
    snapshot_at_or_below,
)
from butter.errors import InvalidRequestError
from butter.kvcodec import RAW, KVCodec
from butter.sampling import allowed_tokens, token_logprob
from butter_backend_mlx.kvcache import CodecKVCache, install_attention, unsupported
from butter_backend_mlx.mtp import HeadDrafts, output_head
from butter_backend_mlx.settings import CPU_PREFILL_STEP, DECODE_PATHS, OPTION_NAMES
from butter_backend_mlx.snapshots import Snapshots, capture, recurrent, restored, state_bytes

if TYPE_CHECKING:
    from butter_backend_mlx.model import MLXModel

log = logging.getLogger("butter.mlx")

GRANULE = KVCache.step  # mlx-lm grows a cache 256 positions at a time
MAX_DRAFT = 12  # drafted tokens one verify pass feeds at most


# mlx-lm architectures whose logits are exactly the output head applied to
# ``model.model(...)``: their last position can be projected alone.
PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _output_head(network):
    """The vocabulary projection of a plain architecture, or None (run the whole model)."""
    if getattr(network, "model_type", None) not in PLAIN_HEADS \
            or not hasattr(network, "model"):
        return None
    head = getattr(network, "lm_head", None)
    return head if head is not None else network.model.embed_tokens.as_linear


class MLXSampler:
    """One request's sampling, in llama.cpp's order: the grammar mask, logit bias,
    penalties over the tokens it drew, then greedy or top-k, top-p, min-p, temperature
    and a draw from its own key."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.last = None
        self.key = mx.random.key(params.seed & 0xFFFFFFFF)
        self.counts: dict[int, int] = {}  # tokens drawn so far, for the penalties
        if params.logit_bias:
            self._bias_ids = mx.array([token for token, _ in params.logit_bias])
            self._bias = mx.array([bias for _, bias in params.logit_bias])

    def sample(self, logits: mx.array, mask=None) -> int:
        logits = logits.astype(mx.float32)
        raw = logits
        if mask is not None:
            allowed = mx.array(allowed_tokens(mask, logits.shape[-1]))
            logits = mx.where(allowed, logits, -mx.inf)
        token = self._draw(self._adjust(logits))
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.params.logprobs is not None:
            self.last = token_logprob(np.array(raw), token, self.params.logprobs)
        return token

    def _adjust(self, logits: mx.array) -> mx.array:
        params = self.params
        if params.logit_bias:
            logits = logits.at[self._bias_ids].add(self._bias)
        if self.counts and (params.frequency_penalty or params.presence_penalty
                            or params.repetition_penalty != 1.0):
            ids = mx.array(list(self.counts))
            counts = mx.array(list(self.counts.values()), dtype=mx.float32)
            seen = logits[ids]
            if params.repetition_penalty != 1.0:
                seen = mx.where(seen > 0, seen / params.repetition_penalty,
                                seen * params.repetition_penalty)
            seen = seen - counts * params.frequency_penalty - params.presence_penalty
            logits = logits.at[ids].add(seen - logits[ids])
        return logits

    def _draw(self, logits: mx.array) -> int:
        params = self.params
        if params.temperature <= 0.0:
            return int(mx.argmax(logits).item())
        ids = None
        if 0 < params.top_k < logits.shape[-1]:  # the k best, ranked: the rest never draws
            ids = mx.argpartition(-logits, params.top_k - 1)[:params.top_k]
            order = mx.argsort(-logits[ids])
            ids = ids[order]
            logits = logits[ids]
        if params.top_p < 1.0:
            ranked = logits if ids is not None else mx.sort(logits)[::-1]
            probs = mx.softmax(ranked)
            kept = int(mx.sum((mx.cumsum(probs) - probs) < params.top_p).item())
            logits = mx.where(logits < ranked[max(kept, 1) - 1], -mx.inf, logits)
        if params.min_p > 0.0:  # tokens less likely than min_p times the best never draw
            floor = mx.max(logits) + float(np.log(params.min_p))
            logits = mx.where(logits < floor, -mx.inf, logits)
        self.key, draw = mx.random.split(self.key)
        choice = mx.random.categorical(logits / params.temperature, key=draw)
        return int((ids[choice] if ids is not None else choice).item())

    def close(self) -> None:
        pass


_FALLBACKS_LOGGED: set[str] = set()


def _log_raw_fallback(codec: KVCodec, reason: str) -> None:
    if codec.name not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add(codec.name)
        log.warning("KV codec %s: the MLX back end cannot store it (%s); serving the cache "
                    "raw (float16)", codec.name, reason)


def _no_codec_cache(model: MLXModel) -> str | None:
    """Why :class:`CodecKVCache` (a codec, a window) cannot serve this model, or None."""
    if model.cache_kinds != {"KVCache"}:
        return "the model keeps caches other than plain attention ones"
    if not install_attention(model.network):
        return "the architecture has its own attention function"
    return None


def _codec_for(model: MLXModel, codec: KVCodec) -> KVCodec | None:
    """``codec`` if this model's caches can store it, else None (logged once: raw)."""
    if codec.raw:
        return None
    _, _, head_dim = model.kv_shape()
    reason = unsupported(codec, head_dim) or _no_codec_cache(model)
    if reason is not None:
        _log_raw_fallback(codec, reason)
        return None
    return codec


class MLXRuntime:
    """The sessions of one MLX model (see the module docstring)."""

    def __init__(self, model: MLXModel, *, kv: KVSpec, capacity: int, n_sessions: int,
                 max_batch: int, options: Mapping[str, object]) -> None:
        unknown = set(options) - OPTION_NAMES
        if unknown:
            raise InvalidRequestError(f"The MLX back end has no option {sorted(unknown)}.")
        if kv.window is not None:
            reason = _no_codec_cache(model)
            if reason is not None:
                raise InvalidRequestError(f"The MLX back end has no KV window for this "
                                          f"model: {reason}.")
            if kv.keep >= kv.window:
                raise InvalidRequestError("The window must be longer than the positions it "
                                          "keeps.")
        if kv.decode_path not in DECODE_PATHS:
            raise InvalidRequestError(f"The MLX back end has no decode path "
                                      f"{kv.decode_path!r}.")
        self._codec = _codec_for(model, kv.codec)
        self._mirror = self._codec is not None and kv.decode_path == "dequant-mirror"
        self._window, self._keep = kv.window, kv.keep
        self._model = model
        self._network = model.network
        self.n_sessions = n_sessions
        on_cpu = mx.default_device() == mx.cpu
        step = int(options.get("prefill_step") or (CPU_PREFILL_STEP if on_cpu else max_batch))
        self.max_batch = max(1, min(max_batch, step))
        # Drafts verify on caches that cut anywhere (no window, no recurrent state).
        self.max_draft = MAX_DRAFT if model.info.can_rewind and kv.window is None else 0
        self._caches: list[list | None] = [None] * n_sessions
        self._lengths = [0] * n_sessions
        self._batch: list | None = None  # batched caches per layer, rows = self._members
        self._members: list[int] = []
        self._head = _output_head(self._network)
        # Qwen3.5's MTP head: every pass keeps its final hidden states for it (mtp.py).
        self._heads: HeadDrafts | None = None
        if model.mtp is not None and kv.window is None and self._codec is None:
            self._heads = HeadDrafts(model.mtp, self._network, n_sessions)
            self._head = output_head(self._network)
        rewinds = model.info.can_rewind
        self.fused = model.info.fusable
        raw_bytes = model.kv_token_bytes()
        budget = capacity * raw_bytes  # the budget holds ``capacity`` tokens at raw cost
        token_bytes, max_positions = raw_bytes, capacity
        if self._codec is not None:
            layers, kv_heads, head_dim = model.kv_shape()
            elements = layers * kv_heads * head_dim
            token_bytes = self._codec.token_bytes(elements, elements)
            if self._mirror:  # the float16 mirror costs what raw does, on top
                token_bytes += raw_bytes
            # A quantized cache holds more tokens in the same bytes, up to the trained context.
            max_positions = max(capacity, min(budget // token_bytes, model.info.n_ctx_train))
        truncate = TruncateKind.ANYWHERE if rewinds else TruncateKind.NEVER
        if kv.window is not None:  # a prompt fits the window; an answer runs past it
            max_positions = kv.window
            truncate = TruncateKind.UNTIL_WRAP
        fork = ForkKind.COPY if rewinds else ForkKind.NONE
        self._snapshots: Snapshots | None = None
        self._lost: set[int] = set()  # sessions a failed step left without their state
        snapshot: dict[str, int] = {}
        if kv.window is None and recurrent(make_prompt_cache(self._network)):
            # Recurrent state (a hybrid's ArraysCache layers): snapshots to resume from.
            self._snapshots = Snapshots(n_sessions)
            snapshot = {"snapshot_bytes": self._measure_state(),
                        "snapshots": self._snapshots.limit,
                        "snapshot_every": self._snapshots.every}
            budget += n_sessions * snapshot["snapshots"] * snapshot["snapshot_bytes"]
            fork, truncate = ForkKind.COPY, TruncateKind.SNAPSHOTS
        # Saved caches are copies of trimmable ones or of recurrent state with its
        # snapshots: no window, no MTP head (its hidden states are per session, not saved).
        saves = (rewinds or self._snapshots is not None) and kv.window is None \
            and self._heads is None
        self.kv = KVFacts(budget_bytes=budget, token_bytes=token_bytes,
                          max_positions=max_positions, fork=fork,
                          truncate=truncate, window=kv.window, granule=GRANULE,
                          saves=saves, **snapshot)
        if kv.window is not None and self.kv.cost(kv.window) > budget:
            raise InvalidRequestError(f"A {kv.window}-token window needs more KV memory than "
                                      f"the {capacity}-token budget holds.")

    def _measure_state(self) -> int:
        """Bytes of one session's recurrent state, measured on one token."""
        caches = make_prompt_cache(self._network)
        self._network(mx.array([[0]]), cache=caches)
        state = capture(caches)
        mx.eval([a for layer in state if layer for a in layer if a is not None])
        return state_bytes(state)

    # ---- steps ---------------------------------------------------------------------

    def step(self, work: Sequence[Work]) -> list[int | None]:
        lost = [item.session for item in work if item.session in self._lost]
        if lost:
            raise StepFailedError(f"sessions {lost} lost their state in a failed step")
        before = {item.session: self._lengths[item.session] for item in work}
        try:
            return self._step(work)
        except Exception as exc:  # nothing of a failed step stays in the cache
            for session, length in before.items():
                self._cut(session, length)
                if self._lengths[session] != length:  # recurrent state with no snapshot
                    self._lost.add(session)  # there: its next step fails, not reads on
            raise StepFailedError(f"MLX step failed: {type(exc).__name__}: {exc}") from exc

    def _step(self, work: Sequence[Work]) -> list[int | None]:
        if self._snapshots is not None:
            work = [self._read_head(item) for item in work]
        results: list[int | None] = [None] * len(work)
        for i, item in enumerate(work):
            if item.draft:
                results[i] = self._verify(item)
        decode = [i for i, item in enumerate(work)
                  if not item.draft and len(item.tokens) == 1 and item.sampler is not None
                  and self._lengths[item.session] > 0]
        if not (self.fused and len(decode) > 1):
            decode = []
        batched = set(decode)
        rest = [i for i in range(len(work)) if i not in batched and not work[i].draft]
        if decode:
            self._decode_batch(work, decode, results)
        groups: dict[int, list[int]] = {}
        for i in rest:
            groups.setdefault(len(work[i].tokens), []).append(i)
        for indices in groups.values():
            if self.fused and len(indices) > 1:
                self._merged_pass(work, indices, results)
            else:
                for i in indices:
                    self._single_pass(work[i], i, results)
        if self._snapshots is not None:  # prefill chunks that end at a multiple
            for i in rest:
                if len(work[i].tokens) > 1 or work[i].sampler is None:
                    self._snapshot(work[i].session)
        return results

    def _read_head(self, item: Work) -> Work:
        """A prompt's last chunk up to its tail snapshot, fed now and snapshotted; the
        rest of the chunk is returned to run with the step (see ``snapshots``)."""
        start = self._lengths[item.session]
        tail = self._snapshots.tail(start + len(item.tokens))
        if item.sampler is None or tail <= start or tail % self._snapshots.every == 0:
            return item
        self._single_pass(Work(item.session, item.tokens[:tail - start]), -1, [])
        self._snapshot(item.session, anywhere=True)
        return attrs.evolve(item, tokens=item.tokens[tail - start:])

    def _snapshot(self, session: int, *, anywhere: bool = False) -> None:
        """Keep ``session``'s recurrent state after a prefill pass that ended at a multiple
        of the spacing (or ``anywhere``: a prompt's tail)."""
        length, caches = self._lengths[session], self._caches[session]
        if caches is not None and (anywhere or length % self._snapshots.every == 0):
            self._snapshots.take(session, length, caches)

    def _single_pass(self, item: Work, index: int, results: list[int | None]) -> None:
        self._leave_batch(item.session)
        caches = self._caches[item.session]
        if caches is None:
            caches = self._caches[item.session] = self._new_caches()
        logits = self._last_logits(mx.array([list(item.tokens)]), caches,
                                   [(item.session, item.tokens)])
        self._lengths[item.session] += len(item.tokens)
        if item.sampler is not None:
            results[index] = item.sampler.sample(logits[0], item.mask)
        else:
            mx.eval([c.state for c in caches])

    def _verify(self, item: Work) -> tuple[int, ...]:
        """The last token and its drafts in one pass of the session's own caches, logits
        at every position; draws in order with the request's own sampler (its random key
        and penalties as plain decoding advances them) until one differs from the next
        draft; the rejected positions are trimmed from the caches."""
        session, draft = item.session, item.draft
        self._leave_batch(session)
        caches = self._caches[session]
        if caches is None:
            caches = self._caches[session] = self._new_caches()
        start = self._lengths[session]
        # Recurrent layers cannot trim: their state before the pass, to feed again what
        # stays when a draft is rejected (a hybrid drafts with its MTP head).
        before = capture(caches) if self._snapshots is not None else None
        tokens = mx.array([list(item.tokens)])
        hidden = None
        if self._heads is not None:
            hidden = self._network.model(tokens, caches)[0]
            logits = self._head(hidden)
            mx.eval(logits, hidden)
        else:
            logits = self._network(tokens, cache=caches)[0]
            mx.eval(logits)
        self._lengths[session] = start + len(item.tokens)
        draws: list[int] = []
        for offset in range(len(draft) + 1):
            draws.append(item.sampler.sample(logits[offset], None))
            if offset == len(draft) or draws[-1] != draft[offset]:
                break
        keep = start + len(draws)
        if before is not None and keep < start + len(item.tokens):
            self._refeed(session, start, before, item.tokens[:len(draws)])
        else:
            self._cut(session, keep)
        if hidden is not None:
            self._heads.record(session, start, list(item.tokens[:len(draws)]),
                               hidden[:len(draws)])
        return tuple(draws)

    def _refeed(self, session: int, start: int, before, tokens: Sequence[int]) -> None:
        """Back to ``session``'s state at ``start`` (recurrent layers from ``before``,
        attention trimmed), then ``tokens`` fed again: the state plain decoding has."""
        caches = restored(self._caches[session], before, self._lengths[session], start, None)
        self._network.model(mx.array([list(tokens)]), caches)
        mx.eval([c.state for c in caches])
        self._caches[session] = caches
        self._lengths[session] = start + len(tokens)

    def _merged_pass(self, work: Sequence[Work], indices: list[int],
                     results: list[int | None]) -> None:
        """Equal-length chunks of several sessions in one left-padded pass."""
        sessions = [work[i].session for i in indices]
        for session in sessions:
            self._leave_batch(session)
        per_session = [self._caches[s] or self._new_caches() for s in sessions]
        merged = [_merge([caches[layer] for caches in per_session])
                  for layer in range(len(per_session[0]))]
        tokens = mx.array([list(work[i].tokens) for i in indices])
        logits = self._last_logits(tokens, merged,
                                   [(s, work[i].tokens) for i, s in zip(indices, sessions)])
        mx.eval(logits)
        for row, (i, session) in enumerate(zip(indices, sessions)):
            self._caches[session] = [layer.extract(row) for layer in merged]
            self._lengths[session] += len(work[i].tokens)
            if work[i].sampler is not None:
                results[i] = work[i].sampler.sample(logits[row], work[i].mask)

    def _decode_batch(self, work: Sequence[Work], indices: list[int],
                      results: list[int | None]) -> None:
        """One token for each decoding session, through the persistent batch."""
        wanted = [work[i].session for i in indices]
        for session in [s for s in self._members if s not in wanted]:
            self._leave_batch(session)
        joining = [s for s in wanted if s not in self._members]
        if joining:
            added = [_merge([self._caches[s][layer] for s in joining])
                     for layer in range(len(self._caches[joining[0]]))]
            if self._batch is None:
                self._batch = added
            else:
                for layer, extra in zip(self._batch, added):
                    layer.extend(extra)
            self._members.extend(joining)
            for session in joining:
                self._caches[session] = None  # its keys and values live in the batch now
        row_of = {session: row for row, session in enumerate(self._members)}
        tokens = [[0]] * len(self._members)
        for i in indices:
            tokens[row_of[work[i].session]] = [work[i].tokens[0]]
        rows = [(s, tokens[row]) if s in wanted else None for row, s in enumerate(self._members)]
        logits = self._last_logits(mx.array(tokens), self._batch, rows)
        mx.eval(logits)
        for i in indices:
            session = work[i].session
            self._lengths[session] += 1
            results[i] = work[i].sampler.sample(logits[row_of[session]], work[i].mask)

    def _new_caches(self) -> list:
        """One session's empty per-layer caches."""
        if self._codec is None and self._window is None:
            return make_prompt_cache(self._network)
        layers, _, _ = self._model.kv_shape()
        return [CodecKVCache(self._codec or RAW, layer=layer, mirror=self._mirror,
                             window=self._window, keep=self._keep)
                for layer in range(layers)]

    def _last_logits(self, tokens: mx.array, cache: list, rows: Sequence = ()) -> mx.array:
        """Logits of each row's last position only: the vocabulary projection of every
        other position is a third of a prefill chunk's work on a CPU, for nothing.
        With an MTP head, ``rows`` (per row: its session and tokens, or None) keep every
        position's hidden state for it; call before the sessions' lengths advance."""
        if self._head is None:
            return self._network(tokens, cache=cache)[:, -1, :]
        hidden = self._network.model(tokens, cache)
        logits = self._head(hidden[:, -1, :])
        if self._heads is not None:
            mx.eval(logits, hidden)
            for row, entry in enumerate(rows):
                if entry is not None:
                    session, fed = entry
                    self._heads.record(session, self._lengths[session], list(fed), hidden[row])
        return logits

    def _leave_batch(self, session: int) -> None:
        """Give ``session`` its own caches back if it is a row of the decode batch."""
        if session not in self._members:
            return
        row = self._members.index(session)
        self._caches[session] = [layer.extract(row) for layer in self._batch]
        self._members.pop(row)
        if not self._members:
            self._batch = None
            return
        keep = mx.array([r for r in range(len(self._members) + 1) if r != row])
        for layer in self._batch:
            layer.filter(keep)

    # ---- sessions ------------------------------------------------------------------

    def draft_room(self, session: int, draft: int) -> int:
        return min(draft, max(self.max_draft, 1 if self._heads is not None else 0))

    def propose(self, session: int, token: int) -> tuple[int, ...]:
        return self._heads.propose(session, token) if self._heads is not None else ()

    def new_sampler(self, params: SamplingParams) -> MLXSampler:
        return MLXSampler(params)

    def truncate(self, session: int, keep: int) -> bool:
        if keep == 0:
            self._lost.discard(session)
        length = self._lengths[session]
        if keep >= length:
            return True
        if self._snapshots is not None:
            if keep > 0 and self._snapshots.get(session, keep) is None:
                return False
        elif keep > 0 and not self.kv.can_truncate(length, keep):
            return False
        self._cut(session, keep)
        return True

    def save(self, session: int, length: int) -> SavedCaches | None:
        """Copies of ``session``'s caches, ``length`` positions, with its recurrent-state
        snapshots if it keeps any (the prompt cache keeps them; a restore copies them
        again, so no session ever writes into them)."""
        if not self.kv.saves or session in self._lost or self._lengths[session] != length \
                or length == 0:
            return None
        self._leave_batch(session)
        caches = self._caches[session]
        if caches is None:
            return None
        snapshots = self._snapshots
        return SavedCaches(_copies(caches, length), length,
                           snapshots.held(session) if snapshots else ())

    def restore(self, session: int, saved: SavedCaches, length: int) -> bool:
        self.truncate(session, 0)
        self._caches[session] = _copies(saved.caches, length)
        self._lengths[session] = length
        if self._snapshots is not None:
            self._snapshots.adopt(session, saved.snapshots)
        return True

    def restorable(self, saved: SavedCaches, keep: int, tail: PromptTail | None = None) -> int:
        return self.kv.reachable(saved.length, keep, None if self._snapshots is None else
                                 lambda at: snapshot_at_or_below(saved.snapshots, at))

    def reachable(self, session: int, keep: int, tail: PromptTail | None = None) -> int:
        snapshots = self._snapshots
        return self.kv.reachable(self._lengths[session], keep, None if snapshots is None
                                 else lambda at: snapshots.last_at_or_below(session, at))

    def _cut(self, session: int, keep: int) -> None:
        self._leave_batch(session)
        length = self._lengths[session]
        caches = self._caches[session]
        snapshots = self._snapshots
        state = snapshots.get(session, keep) if snapshots and keep < length else None
        if snapshots is not None and keep < length and state is None:
            keep = 0  # recurrent state with no snapshot there: only dropping it works
        if self._heads is not None and keep < length:
            self._heads.cut(session, keep)
        if keep == 0 or caches is None:
            self._caches[session] = None
            self._lengths[session] = 0
            if snapshots is not None:
                snapshots.forget(session)
        elif state is not None:
            self._caches[session] = restored(caches, state, length, keep, None)
            self._lengths[session] = keep
            snapshots.forget(session, after=keep)
        elif keep < length:
            for cache in caches:
                cache.trim(length - keep)
            self._lengths[session] = keep

    def fork(self, source: int, target: int, length: int) -> bool:
        if self.kv.fork is ForkKind.NONE or length > self._lengths[source] or source == target:
            return False
        if self.kv.wrapped(self._lengths[source]) and length < self._lengths[source]:
            return False  # its window dropped positions a shorter copy would need
        self._leave_batch(source)
        self._leave_batch(target)
        caches = self._caches[source] or []
        if self._snapshots is not None:
            whole = length == self._lengths[source]
            state = capture(caches) if whole else self._snapshots.get(source, length)
            if state is None:
                return False
            copies = restored(caches, state, self._lengths[source], length, _prefix)
            self._snapshots.share(source, target, length)
        else:
            copies = [_prefix(cache, length) for cache in caches]
        mx.eval([c.state for c in copies if not c.empty()])
        self._caches[target] = copies if length else None
        self._lengths[target] = length
        if self._heads is not None:
            self._heads.fork(source, target, length)
        return True

    def describe(self) -> dict[str, object]:
        codec = self._codec.name if self._codec is not None else "raw"
        return {"device": str(mx.default_device()), "prefill_step": self.max_batch,
                "kv_granule": GRANULE, "caches": sorted(self._model.cache_kinds),
                "kv_codec": codec,
                "kv_decode_path": "dequant-mirror" if self._mirror else "compressed",
                "kv_window": self._window, "kv_window_keep": self._keep,
                "state_snapshots": self._snapshots.limit if self._snapshots else 0}

    def close(self) -> None:
        self._caches = [None] * self.n_sessions
        self._batch = None
        self._members = []
        mx.clear_cache()


@attrs.frozen
class SavedCaches:
    """A session's caches in host memory: copies of them, the tokens they hold and its
    recurrent-state snapshots, ``(position, state)`` (MLX arrays are values: shared)."""

    caches: list
    length: int
    snapshots: tuple = ()


def _merge(caches: list):
    """One batched cache of the sessions' caches of one layer (``BatchKVCache`` for
    mlx-lm's, a many-row ``CodecKVCache`` for a codec's)."""
    return type(caches[0]).merge(caches)


def _copies(caches: list, length: int) -> list:
    """Evaluated copies of a session's caches holding their first ``length`` positions
    (recurrent layers: their state now, which is the state at ``length`` only when that is
    all the session holds)."""
    copies = restored(caches, capture(caches), length, length, _prefix)
    mx.eval([c.state for c in copies if not c.empty()])
    return copies


def _prefix(cache, length: int):
    """A copy of a session's cache holding its first ``length`` positions."""
    if isinstance(cache, CodecKVCache):
        return cache.prefix(length)
    copy = KVCache()
    if length:
        keys, values = cache.keys[..., :length, :], cache.values[..., :length, :]
        copy.keys, copy.values = mx.array(keys), mx.array(values)
        copy.offset = length
    return copy
