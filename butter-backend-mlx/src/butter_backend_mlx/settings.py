"""The MLX back end's settings, declared once: the plugin hands them to ``butter serve``
(flags under the back end's name), the runtime reads the same names. Imports nothing
heavy."""

from __future__ import annotations

from butter.backend import BackendLimits, BackendOption

# Reference-BLAS CPUs prefill a few tokens a second: short passes keep cancellation
# prompt. A GPU prefills long chunks at once.
CPU_PREFILL_STEP = 32
MAX_PREFILL_STEP = 512  # the engine's steps hold at most 512 tokens
DECODE_PATHS = frozenset({"compressed", "dequant-mirror"})


OPTIONS = (
    BackendOption.count(
        "prefill_step", "--prefill-step", maximum=MAX_PREFILL_STEP,
        help=f"tokens one MLX pass may feed across sessions, at most {MAX_PREFILL_STEP} "
             f"(mlx_lm.server's prefill step; default {CPU_PREFILL_STEP} on a CPU, where "
             "short passes keep cancellation prompt, else the engine's step)"),
)
OPTION_NAMES = frozenset(option.name for option in OPTIONS)
LIMITS = BackendLimits()
