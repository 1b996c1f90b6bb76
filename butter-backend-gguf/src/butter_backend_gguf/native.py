"""GGUF checkpoints on llama.cpp through llama-cpp-python's low-level API.

Imported only when a GGUF model is loaded: ``llama_cpp`` is heavy and optional.
The engine thread owns every native object made here; ``close`` frees them at once.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import attrs
import llama_cpp as ll

from butter.backend import (
    ForkKind,
    KVFacts,
    KVSpec,
    ModelInfo,
    PromptTail,
    SamplingParams,
    StepFailedError,
    TruncateKind,
    Work,
    snapshot_at_or_below,
)
from butter.errors import InvalidRequestError, ModelLoadError
from butter.kvcodec import KVCodec
from butter.resolve import ResolvedModel
from butter_backend_gguf.batch import BatchBuilder, GGUFSampler
from butter_backend_gguf.kvtypes import RAW_TYPES, CacheTypes, cache_types, describe_mapping
from butter_backend_gguf.recurrent import StateSnapshots
from butter_backend_gguf.settings import (
    CONTEXT_GRANULE,
    DEFAULT_LAYOUT,
    FA_ROW_BY_ROW_MAX_ROWS,
    LAYOUTS,
    OPTION_NAMES,
    PER_SESSION_MICRO_BATCH,
)

log = logging.getLogger("butter.gguf")

# llama_decode return codes (llama.h).
DECODE_OUTCOMES = {1: "no KV slot for the batch", 2: "aborted", -1: "invalid batch"}
# ggml_log_level (ggml.h).
LOG_WARN, LOG_ERROR = 3, 4

_backend_lock = threading.Lock()
_backend_ready = False
_recent_errors: collections.deque[str] = collections.deque(maxlen=8)


@ll.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace").rstrip()
    if not message:
        return
    if level == LOG_ERROR:
        _recent_errors.append(message)
        log.debug("llama.cpp: %s", message)
    elif level == LOG_WARN:
        log.debug("llama.cpp: %s", message)


def _ensure_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
            ll.llama_backend_init()
            _backend_ready = True


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            return any(line.startswith("flags") and " amx_int8" in line for line in cpuinfo)
    except OSError:
        return False


def model_params():
    """llama.cpp's default model parameters, its extra weight buffer types off on a CPU
    with AMX: the pinned ggml's AMX weight buffers segfault in ggml_backend_amx_mul_mat
    on multi-token batches (ggml-org/llama.cpp#20824; reproduced here on SmolLM2 Q4_1
    with any prompt over one token, and on a Q8_0 Qwen3.5), so weights stay in plain CPU
    buffers."""
    params = ll.llama_model_default_params()
    if cpu_has_amx():
        params.use_extra_bufts = False
    return params


def load_model(resolved: ResolvedModel, *, threads: int | None) -> GGUFModel:
    _ensure_backend()
    params = model_params()
    if not params.use_extra_bufts:
        log.info("CPU has AMX: llama.cpp's extra weight buffer types are off (AMX crashes)")
    _recent_errors.clear()
    handle = ll.llama_model_load_from_file(str(resolved.path).encode(), params)
    if not handle:
        # llama.cpp's own words name paths, sizes and tensors: they go to the log only.
        log.warning("llama.cpp could not load %s: %s", resolved.path,
                    "; ".join(_recent_errors) or "no reason given")
        raise ModelLoadError(resolved.model_id, "llama.cpp refused the file (the server "
                             "log has its reason)")
    return GGUFModel(handle, threads=threads or os.cpu_count() or 1)


class GGUFModel:
    """A loaded GGUF checkpoint: weights, vocabulary, chat template."""

    def __init__(self, handle, *, threads: int) -> None:
        self._handle = handle
        self._vocab = ll.llama_model_get_vocab(handle)
        self.threads = threads
        self._pieces: dict[int, bytes] = {}
        # Recurrent state (Gated DeltaNet, Mamba) that runtimes keep snapshots of.
        self.recurrent_state = bool(ll.llama_model_is_recurrent(handle)
                                    or ll.llama_model_is_hybrid(handle))
        self.info = self._read_info()

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_model_meta_val_str(self._handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self._handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return ll.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    def _read_info(self) -> ModelInfo:
        arch = self._meta("general.architecture") or "unknown"
        template = ll.llama_model_chat_template(self._handle, None)
        recurrent = bool(ll.llama_model_is_recurrent(self._handle))
        hybrid = bool(ll.llama_model_is_hybrid(self._handle))
        # llama.cpp reuses a sliding-window cell once it leaves its sequence's window, so
        # a cache cut short (or shared) may miss positions the window still needs.
        sliding = int(ll.llama_model_n_swa(self._handle)) > 0
        desc = ctypes.create_string_buffer(128)
        ll.llama_model_desc(self._handle, desc, len(desc))
        return ModelInfo(
            architecture=arch,
            n_ctx_train=int(ll.llama_model_n_ctx_train(self._handle)),
            chat_template=template.decode("utf-8") if template else None,
            bos_token=self._token_text(ll.llama_vocab_bos(self._vocab)),
            eos_token=self._token_text(ll.llama_vocab_eos(self._vocab)),
            add_bos=bool(ll.llama_vocab_get_add_bos(self._vocab)),
            can_rewind=not (recurrent or hybrid or sliding),
            # Every session's prompt pieces run alone and one-token rows share a pass
            # (``GGUFRuntime.step``), for hybrid and mixture-of-experts models too.
            fusable=True,
            description=desc.value.decode("utf-8", errors="replace"),
            control_tokens=self._control_tokens(),
            n_vocab=int(ll.llama_vocab_n_tokens(self._vocab)),
            fim_tokens=self._fim_tokens(),
        )

    def _fim_tokens(self) -> tuple[int, int, int] | None:
        vocab = self._vocab
        ids = (ll.llama_vocab_fim_pre(vocab), ll.llama_vocab_fim_suf(vocab),
               ll.llama_vocab_fim_mid(vocab))
        return tuple(int(i) for i in ids) if all(i >= 0 for i in ids) else None

    def _control_tokens(self) -> tuple[str, ...]:
        vocab = self._vocab
        return tuple(
            text for token in range(ll.llama_vocab_n_tokens(vocab))
            if ll.llama_vocab_is_control(vocab, token) and (text := self._token_text(token))
        )

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_special,
                              parse_special)
        if n < 0:
            capacity = -n
            tokens = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(
                self._vocab, data, len(data), tokens, capacity, add_special, parse_special
            )
        return list(tokens[:n])

    def token_piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def is_end_of_generation(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self._vocab, token))

    def create_runtime(self, *, kv: KVSpec, capacity: int, n_sessions: int, max_batch: int,
                       options: Mapping[str, object]) -> GGUFRuntime:
        return GGUFRuntime(self, kv=kv, capacity=capacity, n_sessions=n_sessions,
                           max_batch=max_batch, options=options)

    def kv_token_bytes(self, types: CacheTypes = RAW_TYPES) -> int:
        """Bytes one token's keys and values take across every layer, stored as ``types``."""
        handle = self.handle
        n_head = int(ll.llama_model_n_head(handle))
        head_dim = int(ll.llama_model_n_embd(handle)) // max(n_head, 1)
        elements = head_dim * int(ll.llama_model_n_head_kv(handle)) \
            * int(ll.llama_model_n_layer(handle))
        return types.token_bytes(elements, elements)

    @property
    def handle(self):
        if self._handle is None:
            raise RuntimeError("model is closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            ll.llama_model_free(self._handle)
            self._handle = None
            self._pieces.clear()


# ggml-cpu's flash attention splits a lone row's keys across threads from 512 cells on;
# llama.cpp reads a stream's cells in multiples of 256, so 256 filled cells stay below.
SPLIT_KV_FREE_CELLS = 256
TILED_MIN_ROWS = FA_ROW_BY_ROW_MAX_ROWS + 1  # ggml-cpu flash attention tiles from 64 rows
# Prompt positions below this go row by row (at most one pass of them), later ones tiled.
ROW_BY_ROW_BELOW = FA_ROW_BY_ROW_MAX_ROWS
# A prompt's tail of fewer rows than this, after positions off the prompt path, goes row
# by row (no filler). Row by row costs more per row the more cells a row reads: 14 rows
# after 1,082 cells took 92 ms against 323 ms filled to 64 (6.6 and 5.0 ms a row), even
# at about 49 rows (bench/row_cost.py --tail N --long P).
LOOSE_TAIL_ROWS = 40
# How each position of a session was read (the runtime's marks, ``_mark``): on the prompt
# path its absolute position names (``_prefill``); loose (decode rows, accepted drafts, a
# prompt's last token, a short tail after them: ``_loose_tail``); or in a chat prompt's
# short final message, row by row (``_row_tail``).
PROMPT, LOOSE, TAIL = 0, 1, 2
# Drafted tokens one verify feeds at most: with the last token, under the 64 rows from
# which flash attention tiles (the drafter's cost rule keeps most drafts far shorter).
MAX_DRAFT = FA_ROW_BY_ROW_MAX_ROWS - 1


_MAPPINGS_LOGGED: set[str] = set()


def _log_mapping(codec: KVCodec) -> None:
    """Say once per process how ``codec`` is stored (a swap reuses the line)."""
    if not codec.raw and codec.name not in _MAPPINGS_LOGGED:
        _MAPPINGS_LOGGED.add(codec.name)
        log.info(describe_mapping(codec))


def _cells(model: GGUFModel, types: CacheTypes, capacity: int, streams: int) -> int:
    """KV cells holding what ``capacity`` raw cells' bytes hold, once ``types`` compress
    them: a multiple of the granule per stream, each stream at most the trained context."""
    if not types.quantized:
        return capacity
    cells = capacity * model.kv_token_bytes() // model.kv_token_bytes(types)
    per_stream = cells // streams // CONTEXT_GRANULE * CONTEXT_GRANULE
    return max(capacity // streams, min(per_stream, model.info.n_ctx_train)) * streams


TAIL_SNAPSHOT = 4  # a snapshot this many tokens before a prompt's end (llama-server's 4)


def _tail_snapshot(end: int, every: int) -> int:
    """Where a prompt ending at ``end`` gets its tail snapshot. Never one position either
    side of a multiple of ``every``: that would leave a one-row piece, whose attention
    takes another path than inside a longer piece once a stream holds 256 cells."""
    at = end - TAIL_SNAPSHOT
    if at % every in (1, every - 1):
        at -= 1
    return max(at, 0)


@attrs.frozen
class SavedState:
    """A session's cache in host memory: its state's bytes, the tokens they hold and its
    recurrent-state snapshots, ``(position, bytes)`` (shared: no one writes into them)."""

    data: ctypes.Array
    length: int
    snapshots: tuple[tuple[int, ctypes.Array], ...] = ()
    marks: bytes = b""  # how the runtime read each of its positions (``PROMPT``...)


class GGUFRuntime:
    """One llama.cpp context holding every session's KV, in one of two layouts.

    ``per-session`` (``kv_unified=false``, as llama-server runs): each session is its
    own KV stream of ``capacity / n_sessions`` cells in position order, so attention over
    it never depends on other sessions. Each prompt chunk runs in passes of its own, each
    position on the attention path its absolute position and the request name
    (``_prefill``), and a cached prefix is kept only as far as it was read so
    (``_read_alike``); every
    one-token row (decode rows, a prompt's last token) goes in one shared pass, ordered
    so each row takes the same attention path alone or batched (``_row_order``). The
    same request then gives the same answer whatever runs beside it. Forks copy the
    source's stream.

    ``shared`` (``kv_unified=true``): one cache every session draws cells from, so one
    request may use it all; forks alias cells for free. Cells end up out of position
    order once the cache has holes, which makes answers depend on co-runners.

    Recurrent and hybrid models read prompts in pieces ending at multiples of
    ``SNAPSHOT_EVERY`` and keep snapshots of their recurrent state there
    (:mod:`~butter_backend_gguf.recurrent`): they cut and fork back to a snapshot.
    Sliding-window models neither fork nor cut.
    """

    def __init__(self, model: GGUFModel, *, kv: KVSpec, capacity: int, n_sessions: int,
                 max_batch: int, options: Mapping[str, object]) -> None:
        unknown = set(options) - OPTION_NAMES
        if unknown:
            raise InvalidRequestError(f"The GGUF back end has no option {sorted(unknown)}.")
        self.window, self.window_keep = kv.window, kv.keep
        if kv.window is not None and not model.info.can_rewind:
            raise InvalidRequestError("A recurrent or hybrid model's state cannot shift: "
                                      "no KV window.")
        if kv.window is not None and kv.keep >= kv.window:
            raise InvalidRequestError("The window must be longer than the positions it keeps.")
        if kv.decode_path != "compressed":
            raise InvalidRequestError("llama.cpp attends on its cache as stored: the GGUF "
                                      "back end has no dequant-mirror decode path.")
        types = cache_types(kv.codec) or RAW_TYPES
        _log_mapping(kv.codec)
        self.codec, self.cache_types = kv.codec, types
        layout = str(options.get("kv_layout") or DEFAULT_LAYOUT)
        if layout not in LAYOUTS:
            raise InvalidRequestError(f"kv_layout must be one of {', '.join(LAYOUTS)}.")
        self.layout = layout
        self.per_session = layout == "per-session"
        micro_batch = options.get("micro_batch")
        params = ll.llama_context_default_params()
        streams = n_sessions if self.per_session else 1
        params.n_ctx = _cells(model, types, capacity, streams)
        if kv.window is not None and params.n_ctx // streams < kv.window:
            raise InvalidRequestError(f"A {kv.window}-token window needs that many KV cells "
                                      f"per session; there are {params.n_ctx // streams}.")
        params.n_batch = max_batch
        # Shared layout: same answer batched or alone (on a fresh cache) needs llama.cpp's
        # row-by-row CPU flash attention, taken for micro-batches of 2..63 rows; at 64 rows
        # and more a tiled kernel sums by cell index. Per-session streams keep every row's
        # cells its own and in order, so the tiled kernel's faster prefill is free there.
        default = PER_SESSION_MICRO_BATCH if self.per_session else FA_ROW_BY_ROW_MAX_ROWS
        params.n_ubatch = min(max_batch, int(micro_batch or default))
        params.n_seq_max = n_sessions
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        params.kv_unified = not self.per_session
        if types.quantized:  # llama.cpp quantizes a value cache only under flash attention
            params.type_k, params.type_v = types.ids()
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        _recent_errors.clear()
        ctx = ll.llama_init_from_model(model.handle, params)
        if not ctx:
            reason = "; ".join(_recent_errors) or "llama.cpp could not create a context"
            raise StepFailedError(reason)
        self._ctx = ctx
        self._memory = ll.llama_get_memory(ctx)
        self.micro_batch = int(ll.llama_n_ubatch(ctx))
        self.threads = model.threads
        self.n_sessions = n_sessions
        self.max_batch = max_batch
        self._lengths = [0] * n_sessions
        # Drafts verify exactly only where each verify row takes a plain decode row's
        # attention path (``draft_room``): per-session streams of a model that rewinds.
        self.max_draft = MAX_DRAFT if self.per_session and model.info.can_rewind \
            and kv.window is None and not model.recurrent_state else 0
        # ggml-cpu's flash attention tiles, and splits a lone row's keys, only on a cache
        # of float keys and values: on a quantized one every row reads its cells one by
        # one, whatever its pass holds, so no position or pass changes how a row sums.
        self._one_path = types.quantized
        self._n_vocab = model.info.n_vocab
        self._builder = BatchBuilder(max(max_batch, TILED_MIN_ROWS))
        total = int(ll.llama_n_ctx(ctx))
        per_stream = int(ll.llama_n_ctx_seq(ctx)) if self.per_session else total
        self._stream_cells = per_stream
        # Per session, how each position was read (``PROMPT``, ``LOOSE``, ``TAIL``).
        self._marks: list[bytearray] | None = \
            [bytearray(per_stream) for _ in range(n_sessions)] \
            if self.per_session and kv.window is None and not self._one_path \
            and not model.recurrent_state else None
        token_bytes = model.kv_token_bytes(types)
        rewinds = model.info.can_rewind
        fork = ForkKind.NONE if not rewinds else \
            ForkKind.COPY if self.per_session else ForkKind.ALIAS
        truncate = TruncateKind.ANYWHERE if rewinds else TruncateKind.NEVER
        if kv.window is not None:
            truncate = TruncateKind.UNTIL_WRAP
        self._snapshots: StateSnapshots | None = None
        self._lost: set[int] = set()  # sessions a failed step left without their state
        # A fork between streams copies the buffer at the next llama_decode (llama.cpp's
        # stream copy), cells' metadata at once: until then the target's bytes are not
        # yet its cells', and bytes written into either stream would be copied or lost.
        self._copy_sources: set[int] = set()
        self._copy_targets: set[int] = set()
        snapshot = {}
        if model.recurrent_state:
            token_bytes, snapshot = self._start_snapshots(n_sessions)
            fork = ForkKind.COPY if self.per_session else ForkKind.ALIAS
            truncate = TruncateKind.SNAPSHOTS
        self.kv = KVFacts(budget_bytes=total * token_bytes + n_sessions * snapshot.get(
                              "snapshots", 0) * snapshot.get("snapshot_bytes", 0),
                          token_bytes=token_bytes,
                          max_positions=kv.window or per_stream, fork=fork, truncate=truncate,
                          window=kv.window, per_session=self.per_session,
                          saves=self.per_session and kv.window is None
                          and (rewinds or model.recurrent_state), **snapshot)

    def _start_snapshots(self, n_sessions: int) -> tuple[int, dict[str, int]]:
        """Keep snapshots of the recurrent state. Measured on two tokens fed to session 0
        (then dropped), whatever the architecture keeps: the bytes of one snapshot, and
        of one token's keys and values (only some layers of a hybrid attend)."""
        snapshots = StateSnapshots(self._ctx, self._memory, n_sessions)
        sizes = []
        for position in (0, 1):
            builder = self._builder
            builder.clear()
            builder.add(0, [0], position, False)
            if ll.llama_decode(self._ctx, builder.batch) != 0:
                raise StepFailedError("llama_decode failed measuring the recurrent state")
            sizes.append(int(ll.llama_state_seq_get_size_ext(self._ctx, 0, 0)))
        size = snapshots.measure(0)
        ll.llama_memory_seq_rm(self._memory, 0, 0, -1)
        self._snapshots = snapshots
        return max(sizes[1] - sizes[0], 1), {"snapshot_bytes": size,
                                              "snapshots": snapshots.limit,
                                              "snapshot_every": snapshots.every}

    def step(self, work: Sequence[Work]) -> list[int | None]:
        lost = [item.session for item in work if item.session in self._lost]
        if lost:
            raise StepFailedError(f"sessions {lost} lost their state in a failed step")
        if self.window is not None:
            for item in work:
                self._shift(item.session, len(item.tokens))
        if not self.per_session and self._snapshots is None:
            return self._decode(work, [(item, item.tokens, item.sampler is not None)
                                       for item in work])
        # Per-session (and recurrent state): each chunk alone, a final chunk's last token
        # with the rows.
        before = {item.session: self._lengths[item.session] for item in work}
        results: list[int | None] = [None] * len(work)
        rows: list[int] = []
        try:
            verifies = [index for index, item in enumerate(work) if item.draft]
            if verifies:
                for index, draws in zip(verifies, self._verify([work[i] for i in verifies])):
                    results[index] = draws
            for index, item in enumerate(work):
                if item.draft:
                    continue
                if len(item.tokens) == 1 and item.sampler is not None:
                    rows.append(index)
                    continue
                if self._snapshots is not None and item.sampler is not None:
                    results[index] = self._read_recurrent(item, item.tokens, sample=True)
                    continue
                body = item.tokens[:-1] if item.sampler is not None else item.tokens
                self._prefill(item, body)
                if item.sampler is not None:
                    rows.append(index)
            if rows:
                rows = self._row_order(work, rows)
                tails = [work[i] for i in rows]
                feeds = [(item, item.tokens[-1:], True) for item in tails]
                for i, token in zip(rows, self._decode(tails, feeds)):
                    results[i] = token
                for item in tails:
                    self._mark(item.session, self._lengths[item.session] - 1, 1, LOOSE)
        except StepFailedError:
            for session, length in before.items():  # the step as a whole did not happen
                if not self.truncate(session, length):
                    # Recurrent state already past ``length`` with no snapshot there: the
                    # session is dropped, and fails its next step rather than read on.
                    self.truncate(session, 0)
                    self._lost.add(session)
            raise
        return results

    def _verify(self, items: Sequence[Work]) -> list[tuple[int, ...]]:
        """Feed every drafting session's last token and drafts in one pass of their own,
        logits on every row, then draw row by row as plain decoding would (each
        request's own chain and random state) until a draw differs from the next draft;
        the rejected positions leave the cache. ``draft_room`` kept every row where
        ggml's flash attention takes the row-by-row path however llama.cpp cuts the pass
        into micro-batches, as it does for a plain one-token row there (a float cache's
        first ``SPLIT_KV_FREE_CELLS`` cells, a quantized cache anywhere): each row sums
        alike."""
        builder = self._builder
        builder.clear()
        starts, firsts = [], []
        for item in items:
            start = self._lengths[item.session]
            last = builder.add(item.session, item.tokens, start, True)
            for index in range(last - len(item.draft), last):
                builder.batch.logits[index] = 1
            starts.append(start)
            firsts.append(last - len(item.draft))
        rc = ll.llama_decode(self._ctx, builder.batch)
        self._copied(rc)
        if rc != 0:
            for item, start in zip(items, starts):
                ll.llama_memory_seq_rm(self._memory, item.session, start, -1)
            raise StepFailedError(f"llama_decode failed: {DECODE_OUTCOMES.get(rc, rc)}")
        results = []
        for item, start, first in zip(items, starts, firsts):
            self._lengths[item.session] = start + len(item.tokens)
            draft, draws = item.draft, []
            for offset in range(len(draft) + 1):
                draws.append(item.sampler.sample(self._ctx, first + offset, None))
                if offset == len(draft) or draws[-1] != draft[offset]:
                    break
            self.truncate(item.session, start + len(draws))
            self._mark(item.session, start, len(draws), LOOSE)
            results.append(tuple(draws))
        return results

    def draft_room(self, session: int, draft: int) -> int:
        """Drafts fit while the last verify row stays where a plain decode row takes the
        row-by-row attention path: on a float cache a stream's first 256 cells
        (``_row_order``), on a quantized one the whole stream."""
        if not self.max_draft:
            return 0
        end = self._stream_cells if self._one_path else SPLIT_KV_FREE_CELLS
        room = end - 1 - self._lengths[session]
        return max(0, min(draft, room, self.max_draft))

    def _row_order(self, work: Sequence[Work], rows: list[int]) -> list[int]:
        """One-token rows in the order that fixes how llama.cpp micro-batches them.

        Without a unified cache, llama.cpp puts rows in one micro-batch only while their
        sequence ids climb by one in batch order. ggml's CPU flash attention gives a row
        alone in its micro-batch a path of its own once its stream reaches 512 cells
        (keys split across threads), summing in another order than rows batched
        together. So a row past its stream's first 256 cells (llama.cpp reads cells in
        multiples of 256) always goes alone, and shorter rows batch in runs of
        consecutive sessions: every row takes the same path alone or with company.
        Units go highest session first, so no run picks up a row that is not its own.
        A quantized cache has neither split nor tiled path: long rows batch too.
        """
        def session(i: int) -> int:
            return work[i].session

        long = set() if self._one_path else \
            {i for i in rows if self._lengths[session(i)] + 1 > SPLIT_KV_FREE_CELLS}
        runs: list[list[int]] = []
        for i in sorted((i for i in rows if i not in long), key=session):
            if runs and session(runs[-1][-1]) + 1 == session(i):
                runs[-1].append(i)
            else:
                runs.append([i])
        units = sorted([[i] for i in long] + runs, key=lambda unit: session(unit[0]),
                       reverse=True)
        return [i for unit in units for i in unit]

    def _decode(self, items: Sequence[Work], feeds) -> list[int | None]:
        """One ``llama_decode`` of ``feeds`` ``(item, tokens, wants_logits)``."""
        builder = self._builder
        builder.clear()
        outputs = [builder.add(item.session, tokens, self._lengths[item.session], logits)
                   for item, tokens, logits in feeds]
        rc = ll.llama_decode(self._ctx, builder.batch)
        self._copied(rc)
        if rc != 0:
            for item in items:  # nothing of a failed pass stays in the cache
                ll.llama_memory_seq_rm(self._memory, item.session,
                                       self._lengths[item.session], -1)
            outcome = DECODE_OUTCOMES.get(rc, f"fatal error {rc}")
            raise StepFailedError(f"llama_decode failed: {outcome}")
        for item, tokens, _ in feeds:
            self._lengths[item.session] += len(tokens)
        return [
            item.sampler.sample(self._ctx, index, item.mask) if wants else None
            for (item, _, wants), index in zip(feeds, outputs)
        ]

    def _shift(self, session: int, incoming: int) -> None:
        """Make room for ``incoming`` tokens in ``session``'s window: llama-server's context
        shift. The first ``window_keep`` positions stay (attention sinks, a system prompt);
        half of the rest goes, the newer half moves down, its keys re-rotated by llama.cpp."""
        length = self._lengths[session]
        if length + incoming <= self.window:
            return
        keep = self.window_keep
        discard = min(length - keep, max(incoming, (self.window - keep) // 2))
        ll.llama_memory_seq_rm(self._memory, session, keep, keep + discard)
        ll.llama_memory_seq_add(self._memory, session, keep + discard, -1, -discard)
        self._lengths[session] = length - discard

    def _prefill(self, item: Work, body: Sequence[int]) -> None:
        """Feed a chunk (no logits), each prompt position on the attention path its
        absolute position names, so it is computed the same in whichever chunk it falls;
        a chat prompt's short final message row by row (``_row_tail``), a short tail after
        a decoded answer too (``_loose_tail``).

        ggml's CPU flash attention sums differently for passes under 64 rows of a stream
        (row by row: each row alone) and from 64 on (tiled, the same whatever the
        tiling). Positions below ``ROW_BY_ROW_BELOW`` (63) go row by row, in one pass: a
        short prompt costs only its own rows. Later positions go tiled; a tiled piece
        under 64 rows (a prompt of 65 to 127 tokens, or the tokens after a cached prefix)
        gets filler rows after it (later positions: causal attention hides them from the
        piece) whose cells go at once, so it costs one 64-row pass.

        Row by row is the cheaper way only for the first few dozen positions: past
        them it costs more per row the more cells a row reads. One 256-token prompt took
        0.98 s read row by row to position 256 (in 63-row passes), 0.70 s as read here
        and 0.67 s in one pass; a 20-token prompt 57 ms as read here, 166 ms tiled with
        filler (SmolLM2 Q4_1, 2 threads; bench/row_cost.py --prefill N). A quantized
        cache has no tiled path: the whole chunk goes in one pass."""
        if self._snapshots is not None:
            self._read_recurrent(item, body)
            return
        if not body:
            return
        if self._one_path:  # every row reads its cells one by one, in any pass
            self._decode([item], [(item, body, False)])
            return
        start = self._lengths[item.session]
        if self._loose_tail(item, start, len(body)):
            self._padded(item, body, 2)  # never one row alone: that row splits its keys
            self._mark(item.session, start, len(body), LOOSE)
            return
        row_tail = self._row_tail(item.tail)
        split = len(body) if row_tail is None else max(0, min(len(body), row_tail - start))
        head, rest = body[:split], body[split:]
        rows = max(0, min(len(head), ROW_BY_ROW_BELOW - start))
        if rows:
            self._decode([item], [(item, head[:rows], False)])
        if rows < len(head):
            self._padded(item, head[rows:], TILED_MIN_ROWS)
        self._mark(item.session, start, len(head), PROMPT)
        if rest:
            self._padded(item, rest, 2)
            self._mark(item.session, start + split, len(rest), TAIL)

    def _loose_tail(self, item: Work, start: int, rows: int) -> bool:
        """Whether these ``rows`` of a prompt go row by row, whatever their positions:
        the position before them was not read on the prompt path (a decode row: a
        conversation's answer, resent in its next turn) and fewer than
        ``LOOSE_TAIL_ROWS`` rows of the prompt are left to read before its last token.

        Such a prompt is not read as a fresh read of it would be anyway (its cached
        answer was decoded, not read), so its tail takes the cheaper path instead of a
        64-row pass, and is marked loose. The choice depends only on the cache before
        the tail and on the prompt's length, never on how the tail is cut into chunks:
        the same request reads the same alone or fused (SPEC 5), and asked again it reads
        only its last token, as a row, as it did."""
        marks = self._marks
        left = rows + max(item.prompt_left - 1, 0)
        return marks is not None and start > 0 and left < LOOSE_TAIL_ROWS \
            and marks[item.session][start - 1] == LOOSE

    def _row_tail(self, tail: PromptTail | None) -> int | None:
        """The first position of a chat prompt's final message read row by row (in passes
        of its own rows, one filler row only beside a lone one), or None: from its start
        (or ``ROW_BY_ROW_BELOW``) to the prompt's last token, when that is fewer than
        ``LOOSE_TAIL_ROWS`` rows.

        llama-server reads a new question after a cached system prompt in one short pass
        (row by row); a 64-row pass with filler costs 3.5 times that (323 ms against 92
        for 14 rows after 1,082 cells). The choice depends on the request alone, so a
        cold read of the same prompt puts these rows on the same path (costing it only
        these rows' row-by-row premium, and filler when the rows before them end under
        64 rows into a chunk), and a read that takes the prefix from another request
        keeps only what that request read alike (``_read_alike``)."""
        if tail is None or self._marks is None:
            return None
        start = max(tail.start, ROW_BY_ROW_BELOW)
        return start if 0 < tail.end - 1 - start < LOOSE_TAIL_ROWS else None

    def _read_alike(self, length: int, keep: int, at_or_below: Callable[[int], int] | None,
                    marks: bytes | bytearray, tail: PromptTail | None) -> int:
        """How many of the first ``keep`` of ``length`` cached positions (``marks``) a
        prompt ending in ``tail`` keeps: where the cache can be cut (``KVFacts.reachable``,
        the last snapshot ``at_or_below`` for recurrent state), and of those, all once
        they hold a loose position (a conversation's answer, never read as a fresh read
        reads it; so are its question's rows, kept whichever path they took, as before
        the tail rule: the rest follows ``_loose_tail``), else up to the first whose path
        differs from the one this prompt gives it (``_row_tail``); 0 where the cache
        cannot be cut there (a sliding-window model cuts nowhere)."""
        keep = self.kv.reachable(length, keep, at_or_below)
        if self._marks is None or keep <= 0 or marks.find(LOOSE, 0, keep) >= 0:
            return max(keep, 0)
        row_tail = self._row_tail(tail)
        split = keep if row_tail is None else min(row_tail, keep)
        cut = marks.find(TAIL, 0, split)
        if cut < 0 and split < keep:
            cut = marks.find(PROMPT, split, keep)
        if cut < 0:
            return keep
        return cut if self.kv.can_truncate(length, cut) else 0

    def _mark(self, session: int, start: int, count: int, mark: int) -> None:
        if self._marks is not None and count > 0:
            self._marks[session][start:start + count] = bytes((mark,)) * count

    def _read_recurrent(self, item: Work, tokens: Sequence[int], *,
                        sample: bool = False) -> int | None:
        """Feed ``tokens`` in pieces ending at multiples of the snapshot spacing, row by row
        (no filler: filler rows would enter the recurrent state), keeping a snapshot at
        each multiple; with ``sample``, draw from the last token's logits. The pieces, the
        snapshots and every attention path fall where the absolute positions say, so a
        prompt resumed from a snapshot is read exactly as it was read whole. A prompt's
        last token goes with its piece, not with the one-token rows: its state is then
        the same whether or not the prompt is later resumed past it.

        A prompt's end also gets a snapshot ``TAIL_SNAPSHOT`` tokens before it, as
        llama-server checkpoints 4 tokens before the end: a chat template renders the
        generation prompt's last tokens differently once the answer is in the history
        (``<think>\n`` becomes ``<think>\n\n...``), so the next round shares all but those."""
        session, snapshots = item.session, self._snapshots
        every, done, token = snapshots.every, 0, None
        end = self._lengths[session] + len(tokens)
        tail = _tail_snapshot(end, every) if sample else 0
        while done < len(tokens):
            start = self._lengths[session]
            stop = (start // every + 1) * every
            stop = min(stop, tail) if tail > start else stop
            piece = tokens[done:done + min(stop - start, FA_ROW_BY_ROW_MAX_ROWS)]
            done += len(piece)
            wants = sample and done == len(tokens)
            (token,) = self._decode([item], [(item, piece, wants)])
            reached = start + len(piece)
            if reached % every == 0 or reached == tail:
                snapshots.take(session, reached)
        return token

    def _padded(self, item: Work, piece: Sequence[int], rows: int) -> None:
        """Feed ``piece`` in a pass of at least ``rows`` rows: filler rows after it (later
        positions, hidden from it by causal attention) whose cells go at once."""
        session = item.session
        start = self._lengths[session]
        filler = max(0, rows - len(piece))
        if start + len(piece) + filler > self._stream_cells:
            filler = 0
        self._decode([item], [(item, list(piece) + [piece[-1]] * filler, False)])
        if filler:
            ll.llama_memory_seq_rm(self._memory, session, start + len(piece), -1)
            self._lengths[session] = start + len(piece)

    def _copied(self, rc: int) -> None:
        """A decode that ran did the stream copies forks left pending (an invalid batch
        returns before them: the sets stay, and only keep save and restore away)."""
        if rc == 0:
            self._copy_sources.clear()
            self._copy_targets.clear()

    def new_sampler(self, params: SamplingParams) -> GGUFSampler:
        return GGUFSampler(params, self._n_vocab)

    def truncate(self, session: int, keep: int) -> bool:
        if keep == 0:
            self._lost.discard(session)
        if keep >= self._lengths[session]:
            return True
        snapshots = self._snapshots
        if snapshots is not None and keep > 0:
            if not snapshots.restore(session, keep):
                return False
        elif not ll.llama_memory_seq_rm(self._memory, session, keep, -1):
            return False
        elif snapshots is not None:
            snapshots.forget(session)
        self._lengths[session] = keep
        return True

    def save(self, session: int, length: int) -> SavedState | None:
        """``session``'s cache, ``length`` tokens, as host bytes
        (``llama_state_seq_get_data``, as llama-server's ``--cache-ram`` keeps a slot's
        prompt), with its recurrent-state snapshots if it keeps any. Only per-session
        streams, without a window: restored into an empty stream, the cells land in
        position order as a read puts them, so a restored prefix gives the answers a
        fresh read gives. Not a stream a fork's copy has yet to reach."""
        if not self.kv.saves or session in self._lost or self._lengths[session] != length \
                or length == 0 or session in self._copy_targets:
            return None
        size = int(ll.llama_state_seq_get_size(self._ctx, session))
        buf = (ctypes.c_uint8 * size)()
        if ll.llama_state_seq_get_data(self._ctx, buf, size, session) != size:
            return None
        snapshots = self._snapshots
        marks = bytes(self._marks[session][:length]) if self._marks is not None else b""
        return SavedState(buf, length, snapshots.held(session) if snapshots else (), marks)

    def restore(self, session: int, saved: SavedState, length: int) -> bool:
        """Load what :meth:`save` gave (``length`` tokens) into ``session``, emptied first,
        its snapshots with it; False leaves it empty. Not while a fork's copy into or out
        of ``session`` waits for the next decode: the copy would overwrite the loaded
        bytes, or take them."""
        self.truncate(session, 0)
        if session in self._copy_targets or session in self._copy_sources:
            return False
        data = saved.data
        if ll.llama_state_seq_set_data(self._ctx, data, len(data), session) != len(data):
            ll.llama_memory_seq_rm(self._memory, session, 0, -1)
            return False
        self._lengths[session] = length
        if self._snapshots is not None:
            self._snapshots.adopt(session, saved.snapshots)
        if self._marks is not None:
            self._marks[session][:length] = saved.marks
        return True

    def restorable(self, saved: SavedState, keep: int, tail: PromptTail | None = None) -> int:
        return self._read_alike(saved.length, keep, None if self._snapshots is None else
                                lambda at: snapshot_at_or_below(saved.snapshots, at),
                                saved.marks, tail)

    def reachable(self, session: int, keep: int, tail: PromptTail | None = None) -> int:
        snapshots, marks = self._snapshots, self._marks
        return self._read_alike(self._lengths[session], keep, None if snapshots is None
                                else lambda at: snapshots.last_at_or_below(session, at),
                                marks[session] if marks is not None else b"", tail)

    def fork(self, source: int, target: int, length: int) -> bool:
        if self.kv.fork is ForkKind.NONE or length > self._lengths[source] or source == target:
            return False
        if self._snapshots is not None:
            return self._fork_state(source, target, length)
        ll.llama_memory_seq_rm(self._memory, target, 0, -1)
        if self._marks is not None:
            self._marks[target][:length] = self._marks[source][:length]
        if self.per_session:
            # Streams copy whole (llama.cpp copies the buffer at the next decode); the
            # target then drops what it does not share.
            ll.llama_memory_seq_cp(self._memory, source, target, -1, -1)
            self._copy_sources.add(source)
            self._copy_targets.add(target)
            ll.llama_memory_seq_rm(self._memory, target, length, -1)
        else:
            # One unified KV: the cells gain the target's sequence id, nothing is copied.
            ll.llama_memory_seq_cp(self._memory, source, target, 0, length)
        self._lengths[target] = length
        return True

    def _fork_state(self, source: int, target: int, length: int) -> bool:
        """A fork of a model with recurrent state: the attention keys and values as any
        fork's, the recurrent state from ``source``'s snapshot at ``length`` (or a copy of
        its state now, for its whole length)."""
        snapshots = self._snapshots
        whole = length == self._lengths[source]
        if not whole and snapshots.last_at_or_below(source, length) != length:
            return False
        data = snapshots.copy(source) if whole else None
        ll.llama_memory_seq_rm(self._memory, target, 0, -1)
        snapshots.forget(target)
        self._lengths[target] = 0
        # Per-session streams copy whole, a unified cache aliases cells; either way the
        # target's recurrent state is then replaced by a copy of its own.
        if self.per_session:
            ll.llama_memory_seq_cp(self._memory, source, target, -1, -1)
            self._copy_sources.add(source)
            self._copy_targets.add(target)
        else:
            ll.llama_memory_seq_cp(self._memory, source, target, 0, length)
        done = snapshots.put(target, data, length) and snapshots.share(source, target, length) \
            if whole else snapshots.install(source, target, length)
        if not done:
            ll.llama_memory_seq_rm(self._memory, target, 0, -1)
            snapshots.forget(target)
            return False
        self._lengths[target] = length
        return True

    def describe(self) -> dict[str, object]:
        return {"micro_batch": self.micro_batch, "threads": self.threads,
                "kv_layout": self.layout, "session_cells": self._stream_cells,
                "kv_cache": self.codec.name, "kv_cache_types": str(self.cache_types),
                "kv_window": self.window, "kv_window_keep": self.window_keep,
                "state_snapshots": self._snapshots.limit if self._snapshots else 0,
                "state_snapshot_every": self._snapshots.every if self._snapshots else None}

    def close(self) -> None:
        self._builder.close()
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
