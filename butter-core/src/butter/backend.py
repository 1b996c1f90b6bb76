"""What the engine needs from a back end.

A :class:`Backend` loads a checkpoint into a :class:`LoadedModel` (weights,
tokenizer, chat template). The engine thread then asks the loaded model for one
:class:`Runtime` (a context holding the KV of every session) and drives it with
fused batches. Only the engine thread touches a runtime; ``token_piece`` is called
from the engine thread too. ``tokenize`` runs on request threads (the engine thread
runs model passes and little else), so it may only read the vocabulary.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

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


class ForkKind(enum.Enum):
    """What ``Runtime.fork`` costs."""

    ALIAS = "alias"  # the target shares the source's storage: no new bytes, no compute
    COPY = "copy"  # every layer's keys and values are copied: the target pays for them
    NONE = "none"  # the runtime cannot fork (recurrent state, windows): prefill instead


class TruncateKind(enum.Enum):
    """Where ``Runtime.truncate`` can cut a session's cache."""

    ANYWHERE = "anywhere"
    UNTIL_WRAP = "until_wrap"  # a windowed cache, until it has wrapped
    NEVER = "never"  # recurrent state: only dropping the whole session works


@attrs.frozen
class KVSpec:
    """How the engine asks a runtime to store the KV cache (``--kv-cache`` and friends)."""

    codec: str = "raw"
    window: int | None = None  # keep at most this many positions per session
    keep: int = 0  # positions at the start a window never evicts (attention sinks)
    decode_path: str = "compressed"


@attrs.frozen
class KVFacts:
    """What the KV a runtime holds costs; admission reserves in these units.

    ``budget_bytes`` is the memory every session shares, ``token_bytes`` what one cached
    token costs, ``max_positions`` the longest sequence one session may hold. Storage
    grows in steps of ``granule`` tokens; a windowed cache stops growing at ``window``.
    """

    budget_bytes: int
    token_bytes: int
    max_positions: int
    fork: ForkKind
    truncate: TruncateKind
    window: int | None = None
    granule: int = 1

    def cost(self, tokens: int) -> int:
        """Bytes a session holding ``tokens`` tokens takes."""
        held = min(tokens, self.window) if self.window else tokens
        return -(-held // self.granule) * self.granule * self.token_bytes

    @property
    def capacity(self) -> int:
        """Tokens the whole budget holds."""
        return min(self.budget_bytes // self.token_bytes, self.max_positions) \
            if self.window is None else self.max_positions

    def can_truncate(self, length: int, keep: int) -> bool:
        """Whether a session holding ``length`` tokens can be cut back to ``keep``."""
        if keep >= length or keep == 0:
            return True
        if self.truncate is TruncateKind.ANYWHERE:
            return True
        return self.truncate is TruncateKind.UNTIL_WRAP and self.window is not None \
            and length <= self.window


@attrs.frozen
class Work:
    """One session's part of a step: tokens to feed, then maybe a token to draw."""

    session: int
    tokens: Sequence[int]
    sampler: "Sampler | None" = None  # draw from the last fed position's logits


class StepFailedError(RuntimeError):
    """The back end could not run a step (no KV room, or a native error)."""


DecodeFailedError = StepFailedError  # the name the first contract used


class Sampler(Protocol):
    """One request's sampling state (its own random draws)."""

    def close(self) -> None: ...


class Runtime(Protocol):
    """The KV of every session of one loaded model; only the engine thread touches it.

    Sessions are ids ``0..n_sessions-1``. The runtime owns what they hold: ``step``
    appends, ``truncate`` cuts, ``fork`` copies or aliases, ``truncate(s, 0)`` drops.
    """

    kv: KVFacts
    n_sessions: int
    max_batch: int  # tokens one step may feed across sessions

    def step(self, work: Sequence[Work]) -> list[int | None]:
        """Feed every item's tokens in one pass (or as the back end runs them) and draw
        a token for each item with a sampler; return it per item (None without one).
        Raise :class:`StepFailedError` when the step cannot run: nothing is appended."""

    def new_sampler(self, params: SamplingParams) -> Sampler: ...

    def truncate(self, session: int, keep: int) -> bool:
        """Keep the first ``keep`` tokens of ``session``; False (and nothing dropped) if
        it cannot rewind there (see ``kv.truncate``). ``keep=0`` always works."""

    def fork(self, source: int, target: int, length: int) -> bool:
        """Make ``target`` hold the first ``length`` tokens of ``source``.

        False leaves ``target`` untouched (``kv.fork`` says what a fork costs)."""

    def describe(self) -> dict[str, object]:
        """Back-end facts for the model card (micro-batch rows, threads, ...)."""

    def close(self) -> None: ...


class LoadedModel(Protocol):
    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text``. Called from request threads, never the engine thread,
        and concurrently with model passes: it may only read the vocabulary."""

    def token_piece(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def create_runtime(self, *, kv: KVSpec, capacity: int, n_sessions: int, max_batch: int,
                       options: Mapping[str, object]) -> Runtime:
        """A runtime for ``n_sessions`` sessions whose KV budget holds ``capacity`` tokens
        at raw cost. ``options`` are this back end's own knobs (micro-batch rows...);
        raise ``InvalidRequestError`` naming one it does not know."""

    def close(self) -> None:
        """Free the native checkpoint now (not when the garbage collector gets to it)."""


class Backend(Protocol):
    name: str
    priority: int  # lower wins when several back ends can load a checkpoint

    def can_load(self, resolved: "ResolvedModel") -> bool: ...

    def load(self, resolved: "ResolvedModel", *, threads: int | None = None) -> LoadedModel:
        """Load the checkpoint; raise ``ModelLoadError`` with the loader's reason on failure."""
