"""KV caches that store a codec's keys and values, and attend on them, for the MLX runtime.

One class, :class:`CodecKVCache`, holds one layer's cache for one or many sessions: a
session's own cache is a batch of one row with no padding, and ``merge``, ``extend``,
``filter``, ``extract`` and ``trim`` work as on mlx-lm's left-padded ``BatchKVCache``, so
quantized sessions decode fused in one batch (mlx-lm's ``QuantizedKVCache`` cannot be
merged, which is why ``mlx_lm.server`` serves ``--kv-bits`` one request at a time).

What a row stores, in positions counted from its first token:

- ``affine``: every token's keys and values quantized along the head dimension with
  ``mx.quantize`` (a scale and bias per ``group_size`` elements);
- ``aura``: the same after a per-layer rotation (a Hadamard transform of the head dimension
  with random signs seeded by the layer index) of the post-RoPE keys, and of the values if
  ``codec.rotate_values``. The first ``codec.sinks`` tokens and the newest ``codec.recent``
  stay float16, unrotated: a token is quantized once, when it ages out of the recent window
  (KIVI's residual). A cut (``trim``) does not bring quantized tokens back to float16;
- ``raw`` (only with a window): float16 keys and values as they came.

Windows (``window`` W, ``keep`` S, as mlx-lm's ``RotatingKVCache(max_size, keep)``): a
query at position ``t`` sees the row's first S tokens and those after ``t - (W - S)``, at
most W, however the prompt was chunked. The first S tokens stay float16 in the sinks
buffer (which holds ``max(codec.sinks, S)``); positions older than every row's window are
dropped from the storage, a few dozen at a time, and a row keeps negative padding for
them, so the window batches, merges and extracts like any other row. Until a row has held
more than W tokens nothing of it is dropped, so cutting and copying it stay exact.

Attention. mlx-lm's attention modules call the ``scaled_dot_product_attention`` of their
own module with the cache as a keyword. :func:`install_attention` puts a dispatcher there
once per model module: for a :class:`CodecKVCache` it calls :meth:`CodecKVCache.attend`,
otherwise mlx-lm's function. The dispatcher is the only hook into mlx-lm's code: the
models keep their own RoPE, projections and calls unchanged. ``update_and_fetch`` returns
the cache itself as keys and values, so a model module without the dispatcher fails its
first step loudly instead of attending on something else. ``make_mask`` returns None:
``attend`` builds its masks from the rows' padding and what each position holds.

``attend`` takes scores of the float16 sinks, the quantized positions (through
``mx.quantized_matmul``, with the queries rotated as the keys are, so scores need no
de-rotation) and the float16 recent positions, and puts them through one softmax. Within
a chunk each query sees the newest ``recent`` tokens before it in float16, as it would
have if the chunk were decoded token by token, so prefill chunking changes nothing.

The ``dequant-mirror`` decode path keeps, besides the codec's storage, a float16 copy of
what a decode step reads (sinks and recent tokens exact, the rest dequantized and rotated
back) and decodes through ``mx.fast.scaled_dot_product_attention`` on it; prefill chunks
attend as ``compressed`` does. Both paths read the same numbers.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import base

from butter.kvcodec import KVCodec

MX_BITS = frozenset({2, 3, 4, 5, 6, 8})  # widths mx.quantize packs
MX_GROUPS = frozenset({32, 64, 128})
STEP = 256  # positions the storage grows by, as mlx-lm's caches
DROP_AFTER = 64  # a windowed cache drops positions out of every window this many at a time
ROTATION_SEED = 0x61757261  # "aura": the signs of layer i come from this seed plus i


def unsupported(codec: KVCodec, head_dim: int) -> str | None:
    """Why a :class:`CodecKVCache` cannot store ``codec`` for heads of ``head_dim``."""
    if codec.family not in ("affine", "aura"):
        return f"the {codec.family!r} family has no MLX arithmetic"
    if codec.key_bits not in MX_BITS or codec.value_bits not in MX_BITS:
        return "mx.quantize packs 2, 3, 4, 5, 6 or 8 bits"
    for group in (codec.group_size, codec.value_group):
        if group not in MX_GROUPS or head_dim % group:
            return f"groups of {group} do not tile a head of {head_dim}"
    if (codec.rotate_keys or codec.rotate_values) and head_dim & (head_dim - 1):
        return f"the rotation needs a power-of-two head dimension, not {head_dim}"
    return None


class Rotation:
    """A fixed orthogonal rotation of the head dimension: random signs, then a Hadamard
    transform (``mx.hadamard_transform`` scales by 1/sqrt(n): orthonormal, symmetric)."""

    def __init__(self, layer: int, dim: int) -> None:
        rng = np.random.default_rng(ROTATION_SEED + layer)
        self.signs = mx.array(rng.choice(np.array([-1.0, 1.0], dtype=np.float32), dim))

    def apply(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x * self.signs.astype(x.dtype))

    def invert(self, y: mx.array) -> mx.array:
        return mx.hadamard_transform(y) * self.signs.astype(y.dtype)


def install_attention(network) -> bool:
    """Route the attention of ``network``'s model module through :func:`attention`
    (once per module; idempotent). False if the module calls no such function."""
    module = sys.modules.get(type(network).__module__)
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        return False
    if original is not attention:
        if original is not base.scaled_dot_product_attention:
            return False  # a module's own attention: not one this dispatcher stands in for
        module.scaled_dot_product_attention = attention
    return True


def attention(queries, keys, values, cache, scale, mask, **kwargs):
    """mlx-lm's ``scaled_dot_product_attention``, or the codec cache's own attention."""
    if isinstance(cache, CodecKVCache):
        return cache.attend(queries, scale=scale)
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                             mask=mask, **kwargs)


def _product(x: mx.array, stored: tuple, codec: KVCodec, bits: int, group: int, *,
              transpose: bool) -> mx.array:
    """``x @ stored.T`` (scores) or ``x @ stored`` (values) on a cache's main storage:
    float16 for ``raw``, ``mx.quantize`` parts otherwise."""
    if codec.raw:
        return x @ (stored[0].swapaxes(-1, -2) if transpose else stored[0])
    return mx.quantized_matmul(x, *stored, transpose=transpose, group_size=group, bits=bits)


class CodecKVCache:
    """One layer's keys and values under ``codec``, for one or more left-padded rows.

    Positions are aligned as in ``BatchKVCache``: every row ends at ``_idx``, row ``b``
    starts at ``_pads[b]``. Per row, ``_qend[b]`` is where its quantized positions end:
    the float16 tail holds positions ``[min(_qend), _idx)`` (a row's part before its own
    ``_qend`` is padding), the sinks buffer holds each row's first ``codec.sinks`` tokens.
    """

    step = STEP

    def __init__(self, codec: KVCodec, *, layer: int, mirror: bool = False,
                 rows: int = 1, window: int | None = None, keep: int = 0) -> None:
        self.codec = codec
        self.layer = layer
        self.mirror = mirror and not codec.raw
        self.window = window
        self.keep = keep if window is not None else 0
        # The first ``pinned`` tokens stay float16 in their own buffer: AURA's sinks and a
        # window's kept tokens. The newest ``recent`` stay float16 in the tail.
        self.pinned = max(codec.sinks, self.keep)
        self.recent = 0 if codec.raw else codec.recent
        self._pads = [0] * rows
        self._qend = [0] * rows
        self._idx = 0
        self._rotation: Rotation | None = None
        self.keys_q = self.values_q = None  # (w, scales, biases), (B, H, capacity, ·)
        self.tail_k = self.tail_v = None  # float16, (B, H, _idx - min(_qend), D)
        self.sink_k = self.sink_v = None  # float16, (B, H, sinks, D)
        self.mirror_k = self.mirror_v = None  # float16, (B, H, capacity, D)
        self._step: tuple | None = None  # what the pending attend reads

    # ---- what mlx-lm's models read ----------------------------------------------------

    @property
    def offset(self):
        """Each row's length before the pending tokens: the RoPE offset."""
        if len(self._pads) == 1 and self._pads[0] == 0:
            return self._idx
        return mx.array([self._idx - pad for pad in self._pads])

    def make_mask(self, *args, **kwargs) -> None:
        return None  # attend builds its own masks

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys_q is None

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Every array the cache holds (to evaluate)."""
        parts = [*(self.keys_q or ()), *(self.values_q or ())]
        parts += [a for a in (self.tail_k, self.tail_v, self.sink_k, self.sink_v,
                              self.mirror_k, self.mirror_v) if a is not None]
        return tuple(parts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    # ---- storing -------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store a chunk of post-RoPE keys and values, (B, H, N, D) each."""
        codec = self.codec
        n = keys.shape[2]
        if self.window is not None:
            self._drop_unseen()
        old, idx = self._idx, self._idx + n
        if self._rotation is None and (codec.rotate_keys or codec.rotate_values):
            self._rotation = Rotation(self.layer, keys.shape[-1])
        self._grow(keys, idx)
        start = min(self._qend)
        work_k = keys if self.tail_k is None else mx.concatenate([self.tail_k, keys], axis=2)
        work_v = values if self.tail_v is None else mx.concatenate([self.tail_v, values],
                                                                   axis=2)
        qend = list(self._qend)
        self._step = (work_k, work_v, start, qend, n)
        self._idx = idx
        if self.pinned and any(old - pad < self.pinned for pad in self._pads):
            self._store_sinks(work_k, work_v, start)
        if self.mirror:
            self.mirror_k[..., old:idx, :] = keys
            self.mirror_v[..., old:idx, :] = values
        limit = idx - self.recent
        if limit > start:
            self._quantize(work_k[..., :limit - start, :], work_v[..., :limit - start, :],
                           start, qend)
            self._qend = [max(q, limit) for q in qend]
        keep = idx - min(self._qend)
        self.tail_k = work_k[..., work_k.shape[2] - keep:, :] if keep else None
        self.tail_v = work_v[..., work_v.shape[2] - keep:, :] if keep else None
        return self, self

    def _drop_unseen(self) -> None:
        """Drop the stored positions no query can see again: those older than every row's
        window (a row's kept first tokens live in the sinks buffer). Run once they make up
        ``DROP_AFTER`` positions, so a long generation copies its window rarely.

        Only positions a row would lose to its window even after a cut back to ``window``
        tokens go, so a row is whole while it holds ``window`` tokens or fewer."""
        dead = min(self._idx - self.window, min(self._qend))
        if dead < DROP_AFTER or self.keys_q is None:
            return
        self._idx -= dead
        self._pads = [p - dead for p in self._pads]  # negative: the row began before
        self._qend = [q - dead for q in self._qend]

        def rest(array):
            return None if array is None else array[..., dead:, :]

        self.keys_q = tuple(rest(a) for a in self.keys_q)
        self.values_q = tuple(rest(a) for a in self.values_q)
        self.mirror_k, self.mirror_v = rest(self.mirror_k), rest(self.mirror_v)

    def _grow(self, keys: mx.array, needed: int) -> None:
        if self.keys_q is not None and self.keys_q[0].shape[2] >= needed:
            return
        rows, heads, _, dim = keys.shape
        capacity = -(-needed // self.step) * self.step
        codec = self.codec

        def grown(array, width, dtype):
            fresh = mx.zeros((rows, heads, capacity - self._idx, width), dtype=dtype)
            return fresh if array is None else \
                mx.concatenate([array[..., :self._idx, :], fresh], axis=2)

        def quantized(parts, bits, group):  # mx.quantize: packed words, scales, biases
            if codec.raw:  # float16 as it came
                return (grown(parts and parts[0], dim, keys.dtype),)
            groups = dim // group
            old = parts or (None, None, None)
            return (grown(old[0], dim * bits // 32, mx.uint32),
                    grown(old[1], groups, keys.dtype), grown(old[2], groups, keys.dtype))

        self.keys_q = quantized(self.keys_q, codec.key_bits, codec.group_size)
        self.values_q = quantized(self.values_q, codec.value_bits, codec.value_group)
        if self.mirror:
            self.mirror_k = grown(self.mirror_k, dim, keys.dtype)
            self.mirror_v = grown(self.mirror_v, dim, keys.dtype)

    def _store_sinks(self, work_k: mx.array, work_v: mx.array, start: int) -> None:
        """Copy each row's first tokens from the chunk (its window ``[start, _idx)``)."""
        rows, heads, span, dim = work_k.shape
        sinks = self.pinned
        if self.sink_k is None:
            self.sink_k = mx.zeros((rows, heads, sinks, dim), dtype=work_k.dtype)
            self.sink_v = mx.zeros((rows, heads, sinks, work_v.shape[-1]), dtype=work_v.dtype)
        at = mx.array(self._pads)[:, None] + mx.arange(sinks)[None] - start  # (B, sinks)
        inside = ((at >= 0) & (at < span))[:, None, :, None]
        index = mx.clip(at, 0, span - 1)[:, None, :, None]
        self.sink_k = mx.where(inside, mx.take_along_axis(work_k, index, axis=2), self.sink_k)
        self.sink_v = mx.where(inside, mx.take_along_axis(work_v, index, axis=2), self.sink_v)

    def _quantize(self, keys: mx.array, values: mx.array, start: int, qend: list[int]) -> None:
        """Quantize positions ``[start, start + len)`` of rows that hold them in float16."""
        codec, rotation = self.codec, self._rotation
        stop = start + keys.shape[2]
        if codec.rotate_keys:
            keys = rotation.apply(keys)
        if codec.rotate_values:
            values = rotation.apply(values)
        if codec.raw:
            new_k, new_v = (keys,), (values,)
        else:
            new_k = mx.quantize(keys, group_size=codec.group_size, bits=codec.key_bits)
            new_v = mx.quantize(values, group_size=codec.value_group, bits=codec.value_bits)
        fresh = None  # rows whose positions here are padding or quantized keep theirs
        if any(q > start for q in qend):
            fresh = (mx.arange(start, stop)[None] >= mx.array(qend)[:, None])[:, None, :, None]
        for stored, new in ((self.keys_q, new_k), (self.values_q, new_v)):
            for array, part in zip(stored, new):
                old = array[..., start:stop, :]
                array[..., start:stop, :] = part if fresh is None else mx.where(fresh, part, old)
        if self.mirror:
            self._mirror_quantized(new_k, new_v, start, stop, qend)

    def _mirror_quantized(self, new_k, new_v, start: int, stop: int, qend: list[int]) -> None:
        codec, rotation = self.codec, self._rotation
        deq_k = mx.dequantize(*new_k, group_size=codec.group_size, bits=codec.key_bits)
        deq_v = mx.dequantize(*new_v, group_size=codec.value_group, bits=codec.value_bits)
        if codec.rotate_keys:
            deq_k = rotation.invert(deq_k)
        if codec.rotate_values:
            deq_v = rotation.invert(deq_v)
        first = [max(q, pad + self.pinned) for q, pad in zip(qend, self._pads)]
        aged = (mx.arange(start, stop)[None] >= mx.array(first)[:, None])[:, None, :, None]
        for mirror, deq in ((self.mirror_k, deq_k), (self.mirror_v, deq_v)):
            mirror[..., start:stop, :] = mx.where(aged, deq.astype(mirror.dtype),
                                                  mirror[..., start:stop, :])

    # ---- attending -----------------------------------------------------------------

    def attend(self, queries: mx.array, *, scale: float) -> mx.array:
        """Attention of post-RoPE ``queries`` (B, Hq, N, D) on what the cache holds, the
        chunk ``update_and_fetch`` just stored included.

        A query at position ``t`` of its row sees the positions up to ``t``; under a
        window of ``W`` keeping ``S``, only the first ``S`` of them and those after
        ``t - (W - S)``: at most ``W``, whatever the chunking."""
        if self.mirror and queries.shape[2] == 1:
            return self._attend_mirror(queries, scale)
        codec = self.codec
        work_k, work_v, start, qend, n = self._step
        rows, q_heads, _, dim = queries.shape
        kv_heads = self.keys_q[0].shape[1]
        repeats = q_heads // kv_heads
        queries = (queries * scale).reshape(rows, kv_heads, repeats, n, dim)
        idx, pads = self._idx, mx.array(self._pads)[:, None, None]
        at = mx.arange(idx - n, idx)[None, :, None]  # each query's position, (1, N, 1)
        horizon = mx.maximum(mx.array(qend)[:, None, None], at - self.recent + 1)
        pinned = self.pinned

        def expand(array):
            return mx.expand_dims(array, 2)

        def seen(position):  # in the window of each query (positions past the kept ones)
            return position >= at - (self.window - self.keep) + 1 \
                if self.window is not None else True

        stored = tuple(expand(a[..., :idx, :]) for a in self.keys_q)
        rotated = self._rotation.apply(queries) if codec.rotate_keys else queries
        position = mx.arange(idx)[None, None]
        scores = [_product(rotated, stored, codec, codec.key_bits, codec.group_size,
                           transpose=True)]
        masks = [(position >= pads + pinned) & (position < horizon) & seen(position)]
        if self.recent:
            position = mx.arange(start, idx)[None, None]
            scores.append(queries @ expand(work_k).swapaxes(-1, -2))
            masks.append((position >= mx.maximum(pads + pinned, horizon))
                         & (position <= at) & seen(position))
        if pinned:
            rank = mx.arange(pinned)[None, None]
            scores.append(queries @ expand(self.sink_k).swapaxes(-1, -2))
            masks.append((rank + pads <= at) & ((rank < self.keep) | seen(rank + pads)))
        widths = [s.shape[-1] for s in scores]
        scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
        mask = mx.concatenate(masks, axis=-1) if len(masks) > 1 else masks[0]
        scores = mx.where(mx.expand_dims(mask, (1, 2)), scores, mx.finfo(scores.dtype).min)
        probs = mx.softmax(scores, axis=-1, precise=True)
        parts = mx.split(probs, np.cumsum(widths)[:-1].tolist(), axis=-1)
        values = tuple(expand(a[..., :idx, :]) for a in self.values_q)
        out = _product(parts[0], values, codec, codec.value_bits, codec.value_group,
                       transpose=False)
        if codec.rotate_values:
            out = self._rotation.invert(out)
        floats = [work_v] if self.recent else []
        floats += [self.sink_v] if pinned else []
        for part, value in zip(parts[1:], floats):
            out = out + part.astype(value.dtype) @ expand(value)
        return out.reshape(rows, q_heads, n, -1)

    def _attend_mirror(self, queries: mx.array, scale: float) -> mx.array:
        """A decode step on the float16 mirror (and, under a window, the sinks buffer)."""
        idx, pads = self._idx, mx.array(self._pads)[:, None]
        keys, values = self.mirror_k[..., :idx, :], self.mirror_v[..., :idx, :]
        position = mx.arange(idx)[None]
        if self.window is None:
            mask = position >= pads if any(self._pads) else None
        else:  # the kept tokens from their own buffer, then what the window still sees
            lowest = idx - (self.window - self.keep)
            mask = (position >= pads + self.pinned) & (position >= lowest)
            if self.pinned:
                keys = mx.concatenate([self.sink_k, keys], axis=2)
                values = mx.concatenate([self.sink_v, values], axis=2)
                rank = mx.arange(self.pinned)[None]
                mask = mx.concatenate([(rank + pads < idx) & (
                    (rank < self.keep) | (rank + pads >= lowest)), mask], axis=1)
        if mask is not None:
            mask = mask[:, None, None, :]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)

    def held(self) -> tuple[mx.array, mx.array]:
        """The keys and values a decode step reads now, (B, H, positions, D), in the
        model's own basis: float16 sinks and recent tokens, the rest dequantized."""
        codec, rotation, idx = self.codec, self._rotation, self._idx
        pads = mx.array(self._pads)[:, None, None, None]
        position = mx.arange(idx)[None, None, :, None]
        held = []
        for stored, bits, group, rotated, tail, sinks in (
                (self.keys_q, codec.key_bits, codec.group_size, codec.rotate_keys,
                 self.tail_k, self.sink_k),
                (self.values_q, codec.value_bits, codec.value_group, codec.rotate_values,
                 self.tail_v, self.sink_v)):
            array = stored[0][..., :idx, :] if codec.raw else mx.dequantize(
                *(a[..., :idx, :] for a in stored), group_size=group, bits=bits)
            array = rotation.invert(array) if rotated else array
            if tail is not None:
                start = idx - tail.shape[2]
                front = array[..., :start, :].astype(tail.dtype)
                floats = mx.concatenate([front, tail], axis=2)
                qend = mx.array(self._qend)[:, None, None, None]
                array = mx.where(position >= mx.maximum(qend, pads + self.pinned), floats,
                                 array.astype(tail.dtype))
            if sinks is not None:
                index = mx.clip(position - pads, 0, self.pinned - 1)
                spread = mx.take_along_axis(sinks, mx.broadcast_to(
                    index, (*sinks.shape[:2], idx, 1)), axis=2)
                array = mx.where((position >= pads) & (position < pads + self.pinned),
                                 spread, array.astype(sinks.dtype))
            held.append(array)
        return held[0], held[1]

    # ---- rows: merge, extend, filter, extract, trim, prefix ------------------------

    @classmethod
    def merge(cls, caches: list[CodecKVCache]) -> CodecKVCache:
        """A batch of the given caches' rows, left-padded to the longest (inputs untouched)."""
        merged = caches[0]._blank(rows=0)
        merged._join(caches)
        return merged

    def extend(self, other: CodecKVCache) -> None:
        """Append ``other``'s rows to this batch, in place."""
        joined = self._blank(rows=0)
        joined._join([self, other])
        self.__dict__.update(joined.__dict__)

    def _blank(self, *, rows: int) -> CodecKVCache:
        blank = CodecKVCache(self.codec, layer=self.layer, mirror=self.mirror, rows=rows,
                             window=self.window, keep=self.keep)
        blank._rotation = self._rotation
        return blank

    def _join(self, caches: list[CodecKVCache]) -> None:
        idx = max(c._idx for c in caches)
        self._idx = idx
        self._pads = [p + idx - c._idx for c in caches for p in c._pads]
        self._qend = [q + idx - c._idx for c in caches for q in c._qend]
        self._rotation = next((c._rotation for c in caches if c._rotation), self._rotation)
        if all(c.keys_q is None for c in caches):
            return

        def stack(get, length: int, *, aligned: bool = False) -> mx.array | None:
            """Each cache's ``get(c)``, its positions ending at ``idx``, padded on the left
            to ``length`` (``aligned``: a buffer whose positions past ``_idx`` are stale)."""
            arrays = [get(c) for c in caches]
            like = next((a for a in arrays if a is not None), None)
            if like is None:
                return None
            parts = []
            for c, array in zip(caches, arrays):
                if array is None:
                    array = mx.zeros((len(c._pads), like.shape[1], 0, like.shape[3]),
                                     dtype=like.dtype)
                elif aligned:
                    array = array[..., :c._idx, :]
                if array.shape[2] < length:
                    array = mx.pad(array, [(0, 0), (0, 0), (length - array.shape[2], 0),
                                           (0, 0)])
                parts.append(array)
            return mx.concatenate(parts)

        parts = 1 if self.codec.raw else 3  # float16, or mx.quantize's words, scales, biases
        self.keys_q = tuple(stack(lambda c, i=i: c.keys_q and c.keys_q[i], idx, aligned=True)
                            for i in range(parts))
        self.values_q = tuple(stack(lambda c, i=i: c.values_q and c.values_q[i], idx,
                                    aligned=True) for i in range(parts))
        tail = idx - min(self._qend)
        if tail:
            self.tail_k = stack(lambda c: c.tail_k, tail)
            self.tail_v = stack(lambda c: c.tail_v, tail)
        self.sink_k = stack(lambda c: c.sink_k, self.pinned)
        self.sink_v = stack(lambda c: c.sink_v, self.pinned)
        if self.mirror:
            self.mirror_k = stack(lambda c: c.mirror_k, idx, aligned=True)
            self.mirror_v = stack(lambda c: c.mirror_v, idx, aligned=True)

    def filter(self, batch_indices) -> None:
        """Keep the rows ``batch_indices`` (in that order), in place; drop shared padding."""
        rows = [int(i) for i in np.array(batch_indices).reshape(-1)]
        take = mx.array(rows)
        tail = self._idx - min(self._qend)  # the float16 tail's length, every row's
        self._pads = [self._pads[i] for i in rows]
        self._qend = [self._qend[i] for i in rows]
        shift = max(0, min(self._pads))  # a row that began before the storage: none
        self._pads = [p - shift for p in self._pads]
        self._qend = [q - shift for q in self._qend]
        self._idx -= shift
        if self.keys_q is None:
            return

        def kept(array, start=0):
            return None if array is None else array[take][..., start:, :]

        self.keys_q = tuple(kept(a, shift) for a in self.keys_q)
        self.values_q = tuple(kept(a, shift) for a in self.values_q)
        self.mirror_k, self.mirror_v = kept(self.mirror_k, shift), kept(self.mirror_v, shift)
        self.sink_k, self.sink_v = kept(self.sink_k), kept(self.sink_v)
        keep = self._idx - min(self._qend)
        self.tail_k = kept(self.tail_k, tail - keep) if keep else None
        self.tail_v = kept(self.tail_v, tail - keep) if keep else None

    def extract(self, row: int) -> CodecKVCache:
        """Row ``row`` as a session's own cache (no padding, its own copies)."""
        pad, qend = self._pads[row], self._qend[row]
        cut = max(pad, 0)  # a row that began before the storage keeps its negative pad
        one = self._blank(rows=1)
        one._idx, one._qend, one._pads = self._idx - cut, [qend - cut], [pad - cut]
        if self.keys_q is None:
            return one

        def part(array, start, stop=None):
            if array is None:
                return None
            return mx.contiguous(array[row:row + 1, :, start:stop])

        one.keys_q = tuple(part(a, cut, self._idx) for a in self.keys_q)
        one.values_q = tuple(part(a, cut, self._idx) for a in self.values_q)
        one.mirror_k = part(self.mirror_k, cut, self._idx)
        one.mirror_v = part(self.mirror_v, cut, self._idx)
        one.sink_k, one.sink_v = part(self.sink_k, 0), part(self.sink_v, 0)
        tail, keep = self._idx - min(self._qend), self._idx - qend
        if keep:
            one.tail_k = part(self.tail_k, tail - keep)
            one.tail_v = part(self.tail_v, tail - keep)
        return one

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop every row's newest ``n`` positions; quantized ones stay quantized."""
        n = min(n, self._idx)
        start = min(self._qend)
        self._idx -= n
        self._qend = [min(q, self._idx) for q in self._qend]
        keep = self._idx - start
        if keep > 0:
            self.tail_k, self.tail_v = self.tail_k[..., :keep, :], self.tail_v[..., :keep, :]
        else:
            self.tail_k = self.tail_v = None
        return n

    def prefix(self, length: int) -> CodecKVCache:
        """A copy of this one-row cache's first ``length`` positions (a fork; exact while
        the row has dropped nothing, or for its whole length)."""
        view = self._blank(rows=1)
        view.__dict__.update(self.__dict__, _qend=list(self._qend))
        view.trim(self._idx - self._pads[0] - length)
        return view.extract(0)
