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
from typing import Mapping, Sequence

import llama_cpp as ll

from butter.backend import (
    ForkKind,
    KVFacts,
    KVSpec,
    ModelInfo,
    SamplingParams,
    StepFailedError,
    TruncateKind,
    Work,
)
from butter.errors import InvalidRequestError, ModelLoadError
from butter.resolve import ResolvedModel

log = logging.getLogger("butter.gguf")

# llama_decode return codes (llama.h).
DECODE_OUTCOMES = {1: "no KV slot for the batch", 2: "aborted", -1: "invalid batch"}
# ggml-cpu's flash attention is tiled from GGML_FA_TILE_Q (64) query rows up.
FA_ROW_BY_ROW_MAX_ROWS = 63
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


def load_model(resolved: ResolvedModel, *, threads: int | None) -> "GGUFModel":
    _ensure_backend()
    params = ll.llama_model_default_params()
    if cpu_has_amx():
        # The pinned ggml's AMX weight buffers segfault in ggml_backend_amx_mul_mat on
        # multi-token batches (ggml-org/llama.cpp#20824; reproduced here on SmolLM2 Q4_1
        # with any prompt over one token), so weights stay in plain CPU buffers.
        params.use_extra_bufts = False
        log.info("CPU has AMX: llama.cpp's extra weight buffer types are off (AMX crashes)")
    _recent_errors.clear()
    handle = ll.llama_model_load_from_file(str(resolved.path).encode(), params)
    if not handle:
        reason = "; ".join(_recent_errors) or "llama.cpp could not load the file"
        raise ModelLoadError(resolved.model_id, reason)
    return GGUFModel(handle, threads=threads or os.cpu_count() or 1)


class GGUFModel:
    """A loaded GGUF checkpoint: weights, vocabulary, chat template."""

    def __init__(self, handle, *, threads: int) -> None:
        self._handle = handle
        self._vocab = ll.llama_model_get_vocab(handle)
        self.threads = threads
        self._pieces: dict[int, bytes] = {}
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
        experts = int(self._meta(f"{arch}.expert_count") or 0)
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
            fusable=not (recurrent or hybrid or experts > 0),
            description=desc.value.decode("utf-8", errors="replace"),
            control_tokens=self._control_tokens(),
        )

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
        n = ll.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_special, parse_special)
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
                       options: Mapping[str, object]) -> "GGUFRuntime":
        return GGUFRuntime(self, kv=kv, capacity=capacity, n_sessions=n_sessions,
                           max_batch=max_batch, options=options)

    def kv_token_bytes(self, element_bytes: int) -> int:
        """Bytes one token's keys and values take across every layer."""
        handle = self.handle
        n_head = int(ll.llama_model_n_head(handle))
        head_dim = int(ll.llama_model_n_embd(handle)) // max(n_head, 1)
        kv_width = head_dim * int(ll.llama_model_n_head_kv(handle))
        return int(ll.llama_model_n_layer(handle)) * 2 * kv_width * element_bytes

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


class GGUFSampler:
    """One request's llama_sampler chain (own seed, own random draws)."""

    def __init__(self, params: SamplingParams) -> None:
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.temperature <= 0.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        self.chain = chain

    def close(self) -> None:
        if self.chain is not None:
            ll.llama_sampler_free(self.chain)
            self.chain = None


class BatchBuilder:
    """A checked writer over one ``llama_batch``: capacity first, explicit positions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.batch = ll.llama_batch_init(capacity, 0, 1)
        self.n_tokens = 0

    def clear(self) -> None:
        self.n_tokens = 0

    def add(self, seq_id: int, tokens: Sequence[int], position: int, wants_logits: bool) -> int:
        """Write consecutive tokens of one sequence; return the batch index of the last."""
        count = len(tokens)
        if count == 0 or self.n_tokens + count > self.capacity:
            raise StepFailedError(
                f"batch overflow: {self.n_tokens} + {count} tokens > capacity {self.capacity}"
            )
        batch, start = self.batch, self.n_tokens
        for offset, token in enumerate(tokens):
            index = start + offset
            batch.token[index] = token
            batch.pos[index] = position + offset
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq_id
            batch.logits[index] = 0
        last = start + count - 1
        batch.logits[last] = 1 if wants_logits else 0
        self.n_tokens = start + count
        batch.n_tokens = self.n_tokens
        return last

    def close(self) -> None:
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None


OPTIONS = frozenset({"micro_batch"})
F16_BYTES = 2


class GGUFRuntime:
    """One llama.cpp context: a unified KV shared by every session (one seq id each).

    Forks alias cells (``llama_memory_seq_cp`` tags them, nothing is copied), so they
    cost no bytes; recurrent, hybrid and sliding-window models neither fork nor cut.
    """

    def __init__(self, model: GGUFModel, *, kv: KVSpec, capacity: int, n_sessions: int,
                 max_batch: int, options: Mapping[str, object]) -> None:
        unknown = set(options) - OPTIONS
        if unknown:
            raise InvalidRequestError(f"The GGUF back end has no option {sorted(unknown)}.")
        if kv != KVSpec():
            raise InvalidRequestError("The GGUF back end stores the KV cache raw, unwindowed.")
        micro_batch = options.get("micro_batch")
        params = ll.llama_context_default_params()
        params.n_ctx = capacity
        params.n_batch = max_batch
        # Same answer batched or alone (on a fresh cache): llama.cpp's CPU flash attention
        # takes a row-by-row path that only reads a session's own KV cells, in cell order,
        # for micro-batches of 2..63 rows; at 64 rows and more every row of the pass goes
        # through a tiled kernel whose sums depend on where other sessions' cells sit. The
        # tiled kernel prefills long prompts faster: ``--ubatch-size 512`` picks it.
        params.n_ubatch = min(max_batch, int(micro_batch or FA_ROW_BY_ROW_MAX_ROWS))
        params.n_seq_max = n_sessions
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        params.kv_unified = True
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
        self._builder = BatchBuilder(max_batch)
        positions = int(ll.llama_n_ctx(ctx))
        token_bytes = model.kv_token_bytes(F16_BYTES)
        rewinds = model.info.can_rewind
        self.kv = KVFacts(budget_bytes=positions * token_bytes, token_bytes=token_bytes,
                          max_positions=positions,
                          fork=ForkKind.ALIAS if rewinds else ForkKind.NONE,
                          truncate=TruncateKind.ANYWHERE if rewinds else TruncateKind.NEVER)

    def step(self, work: Sequence[Work]) -> list[int | None]:
        builder = self._builder
        builder.clear()
        outputs = [builder.add(item.session, item.tokens, self._lengths[item.session],
                               item.sampler is not None) for item in work]
        rc = ll.llama_decode(self._ctx, builder.batch)
        if rc != 0:
            for item in work:  # nothing of a failed step stays in the cache
                ll.llama_memory_seq_rm(self._memory, item.session, self._lengths[item.session],
                                       -1)
            outcome = DECODE_OUTCOMES.get(rc, f"fatal error {rc}")
            raise StepFailedError(f"llama_decode failed: {outcome}")
        for item in work:
            self._lengths[item.session] += len(item.tokens)
        return [
            int(ll.llama_sampler_sample(item.sampler.chain, self._ctx, index))
            if item.sampler is not None else None
            for item, index in zip(work, outputs)
        ]

    def new_sampler(self, params: SamplingParams) -> GGUFSampler:
        return GGUFSampler(params)

    def truncate(self, session: int, keep: int) -> bool:
        if keep >= self._lengths[session]:
            return True
        if not ll.llama_memory_seq_rm(self._memory, session, keep, -1):
            return False
        self._lengths[session] = keep
        return True

    def fork(self, source: int, target: int, length: int) -> bool:
        if self.kv.fork is ForkKind.NONE or length > self._lengths[source]:
            return False
        # One unified KV: the cells gain the target's sequence id, nothing is copied.
        ll.llama_memory_seq_rm(self._memory, target, 0, -1)
        ll.llama_memory_seq_cp(self._memory, source, target, 0, length)
        self._lengths[target] = length
        return True

    def describe(self) -> dict[str, object]:
        return {"micro_batch": self.micro_batch, "threads": self.threads}

    def close(self) -> None:
        self._builder.close()
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
