"""What the engine needs from a back end.

A :class:`Backend` loads a checkpoint into a :class:`LoadedModel` (weights,
tokenizer, chat template). The engine thread then asks the loaded model for one
:class:`Runtime` (a context holding the KV of every session) and drives it with
fused batches. Only the engine thread touches a runtime; ``token_piece`` is called
from the engine thread too. ``tokenize`` runs on request threads (the engine thread
runs model passes and little else), so it may only read the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import attrs

if TYPE_CHECKING:
    from butter.resolve import ResolvedModel


@attrs.frozen
class ModelInfo:
    """Facts about a loaded checkpoint the core needs."""

    architecture: str
    n_ctx_train: int
    chat_template: str | None
    bos_token: str
    eos_token: str
    add_bos: bool
    # Recurrent / hybrid state cannot rewind: only whole-sequence prefixes are reusable.
    can_rewind: bool = True
    # Whether many sessions may share one model pass (dense attention models).
    fusable: bool = True
    description: str = ""
    # Texts of the control tokens (``<|im_start|>``…): client text never becomes one.
    control_tokens: tuple[str, ...] = ()


@attrs.frozen
class SamplingParams:
    temperature: float
    top_p: float
    seed: int
    top_k: int = 40


@attrs.frozen
class BatchEntry:
    """Consecutive tokens of one session, starting at position ``position``."""

    seq_id: int
    tokens: Sequence[int]
    position: int
    wants_logits: bool  # only the last token of the entry produces logits


class DecodeFailedError(RuntimeError):
    """The back end could not run a batch (no KV slot, or a native error)."""


class Sampler(Protocol):
    def close(self) -> None: ...


class Runtime(Protocol):
    capacity: int  # KV cells across all sessions
    n_sessions: int
    max_batch: int
    micro_batch: int  # rows per native micro-batch

    def decode(self, entries: Sequence[BatchEntry]) -> list[int]:
        """Run one model pass; return, per entry wanting logits, its output index."""

    def new_sampler(self, params: SamplingParams) -> Sampler: ...

    def sample(self, sampler: Sampler, output_index: int) -> int:
        """Draw (and accept) the next token from the logits at ``output_index``."""

    def forget(self, seq_id: int, start: int) -> bool:
        """Drop positions ``start..`` of a session's KV; False if it cannot rewind."""

    def share(self, source_seq: int, target_seq: int, length: int) -> bool:
        """Give ``target_seq`` (empty) positions ``0..length`` of ``source_seq``'s KV.

        False if the back end cannot; the target then prefills the prompt itself.
        """

    def close(self) -> None: ...


class LoadedModel(Protocol):
    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text``. Called from request threads, never the engine thread,
        and concurrently with model passes: it may only read the vocabulary."""

    def token_piece(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def create_runtime(self, *, capacity: int, n_sessions: int, max_batch: int,
                       micro_batch: int | None = None) -> Runtime: ...

    def close(self) -> None:
        """Free the native checkpoint now (not when the garbage collector gets to it)."""


class Backend(Protocol):
    name: str
    priority: int  # lower wins when several back ends can load a checkpoint

    def can_load(self, resolved: "ResolvedModel") -> bool: ...

    def load(self, resolved: "ResolvedModel", *, threads: int | None = None) -> LoadedModel:
        """Load the checkpoint; raise ``ModelLoadError`` with the loader's reason on failure."""
