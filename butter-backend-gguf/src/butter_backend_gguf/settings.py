"""The GGUF back end's settings and llama.cpp's limits, declared once.

The plugin hands them to ``butter serve`` (flags under the back end's name, checked
before anything loads); the runtime reads the same names. Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping

from butter.backend import BackendLimits, BackendOption, SessionLayout

LAYOUTS = ("per-session", "shared")
DEFAULT_LAYOUT = "per-session"  # chosen by bench/batch_invariance.py and concurrency.py
PER_SESSION_MICRO_BATCH = 512
# ggml-cpu's flash attention is tiled from GGML_FA_TILE_Q (64) query rows up.
FA_ROW_BY_ROW_MAX_ROWS = 63
MAX_MICRO_BATCH = 512  # rows of one llama_decode (the engine's steps hold at most 512)
CONTEXT_GRANULE = 256  # llama.cpp pads a stream's cells to this; butter takes exact ones
MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ
SPARE_SESSIONS = 2  # idle caches the pool keeps beside the active sessions
MAX_THREADS = 512  # GGML_MAX_N_THREADS


OPTIONS = (
    BackendOption.count(
        "micro_batch", "--ubatch-size", maximum=MAX_MICRO_BATCH,
        help=f"rows per llama.cpp micro-batch (llama-server's -ub), at most {MAX_MICRO_BATCH} "
             f"(default {PER_SESSION_MICRO_BATCH} per-session, {FA_ROW_BY_ROW_MAX_ROWS} "
             "shared: under 64 rows a shared cache answers the same alone or batched while "
             "it has no holes)"),
    BackendOption(
        name="kv_layout", flag="--kv-layout", choices=LAYOUTS, default=DEFAULT_LAYOUT,
        help="a KV stream per session, --max-context / --parallel cells each, answers "
             "independent of co-runners (per-session, the default), or one cache shared by "
             "all (shared)"),
)
OPTION_NAMES = frozenset(option.name for option in OPTIONS)
LIMITS = BackendLimits(max_parallel=MAX_SEQUENCES - SPARE_SESSIONS, max_threads=MAX_THREADS,
                       context_granule=CONTEXT_GRANULE)


def session_layout(options: Mapping[str, object], parallel: int) -> SessionLayout:
    """Per-session: a stream per active session (llama-server's slots), an idle session
    keeps its cache in its own stream. Shared: one cache, the engine's spare sessions."""
    if (options.get("kv_layout") or DEFAULT_LAYOUT) == "per-session":
        return SessionLayout(n_sessions=parallel, streams=parallel, prompt_cache=True)
    return SessionLayout()
