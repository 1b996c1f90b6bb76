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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from butter.errors import InvalidRequestError
from butter.kvcodec import RAW, KVCodec

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
    n_vocab: int = 0  # logits per position (token ids run below it)
    # Fill-in-the-middle tokens (prefix, suffix, middle), if the vocabulary has them.
    fim_tokens: tuple[int, int, int] | None = None
    # The checkpoint's own draft head runs (Qwen3.5's multi-token prediction): the
    # runtime drafts with ``Runtime.propose`` (``--speculation mtp``).
    draft_head: bool = False


@attrs.frozen
class SamplingParams:
    """How one request draws its tokens (see :class:`butter.generation.GenerationParams`).

    The order is llama.cpp's: the grammar mask (``Work.mask``), logit bias, penalties over
    the tokens this sampler drew, top-k, top-p, min-p, temperature, then a draw from the
    request's own random state (greedy at temperature 0). With ``logprobs`` set, each
    draw also records the model's own log-probabilities (``Sampler.last``)."""

    temperature: float
    top_p: float
    seed: int
    top_k: int = 40
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    logprobs: int | None = None  # None: none; k: the drawn token's and the k most likely


@attrs.frozen
class TokenLogprob:
    """A drawn token's log-probability under the model (before mask, bias, penalties and
    temperature, as vLLM and llama-server report it) and the ``k`` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # Recurrent state restored from a snapshot: only back to where the runtime kept one
    # (``Runtime.reachable`` says where); attention keys and values are cut there.
    SNAPSHOTS = "snapshots"


@attrs.frozen
class KVSpec:
    """How the engine asks a runtime to store the KV cache (``--kv-cache`` and friends).

    A runtime that cannot store ``codec`` logs so once and stores the cache raw."""

    codec: KVCodec = RAW
    window: int | None = None  # keep at most this many positions per session
    keep: int = 0  # positions at the start a window never evicts (attention sinks)
    decode_path: str = "compressed"  # or "dequant-mirror": a dequantized copy to decode on


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
    # Each session owns ``max_positions`` cells no other may use (a KV stream per
    # session): admission never evicts one session's cache to make room for another.
    per_session: bool = False
    # Recurrent state (hybrid models): a session keeps up to ``snapshots`` copies of it,
    # ``snapshot_bytes`` each, one per ``snapshot_every`` tokens fed at most.
    snapshot_bytes: int = 0
    snapshots: int = 0
    snapshot_every: int = 1
    # ``Runtime.save`` copies a session's cache to host memory and ``restore`` puts it
    # back (the prompt cache, ``--cache-ram``).
    saves: bool = False

    def cost(self, tokens: int) -> int:
        """Bytes a session holding ``tokens`` tokens takes, its state snapshots included."""
        held = min(tokens, self.window) if self.window else tokens
        kept = min(self.snapshots, tokens // max(self.snapshot_every, 1))
        return -(-held // self.granule) * self.granule * self.token_bytes \
            + kept * self.snapshot_bytes

    @property
    def capacity(self) -> int:
        """Tokens the whole budget holds."""
        return min(self.budget_bytes // self.token_bytes, self.max_positions) \
            if self.window is None else self.max_positions

    def wrapped(self, length: int) -> bool:
        """Whether a session that was fed ``length`` tokens has dropped some (its window
        shifted): its cache then no longer holds a prefix of them to reuse or fork."""
        return self.window is not None and length > self.window

    def reachable(self, length: int, keep: int,
                  snapshot_at_or_below: Callable[[int], int] | None = None) -> int:
        """The longest prefix, at most ``keep`` tokens, that a session holding ``length``
        can be cut back to: the last snapshot at or below ``keep`` where the runtime keeps
        snapshots (``snapshot_at_or_below``), else ``keep`` if it can cut there, else 0."""
        if keep >= length:
            return length
        if snapshot_at_or_below is not None:
            return snapshot_at_or_below(keep)
        return keep if self.can_truncate(length, keep) else 0

    def can_truncate(self, length: int, keep: int) -> bool:
        """Whether a session holding ``length`` tokens can be cut back to ``keep``."""
        if keep >= length or keep == 0:
            return True
        if self.truncate is TruncateKind.ANYWHERE:
            return True
        # SNAPSHOTS: only the runtime knows where it kept one (``Runtime.reachable``).
        return self.truncate is TruncateKind.UNTIL_WRAP and self.window is not None \
            and length <= self.window


@attrs.frozen
class PromptTail:
    """A chat prompt's last message and what follows it (the generation prompt): prompt
    positions ``start`` to ``end`` (the prompt's length). ``start`` is where the prompt
    departs from the rendering of every message before the last: it depends on the
    request alone, and every new question on one system prompt starts its tail at the
    same position."""

    start: int
    end: int


@attrs.frozen
class Work:
    """One session's part of a step: tokens to feed, then maybe a token to draw."""

    session: int
    tokens: Sequence[int]
    sampler: Sampler | None = None  # draw from the last fed position's logits
    # Tokens the draw may pick: a packed int32 bitmask (bit ``t % 32`` of word ``t // 32``
    # set means token ``t`` is allowed), as a grammar engine writes it; None: any token.
    mask: object | None = None
    # Speculation: ``tokens`` ends with these drafted tokens (``tokens[0]`` is the last
    # drawn one). The runtime draws at each of the last ``len(draft) + 1`` positions in
    # order, exactly as plain decoding would draw there, and stops at the first draw that
    # differs from the draft token after it; ``step`` returns that item's draws as a tuple
    # (the accepted drafts, then the draw that ended them) and drops the rejected
    # positions from the cache. Only with a sampler and no mask, on a runtime with
    # ``max_draft`` at least ``len(draft)``.
    draft: tuple[int, ...] = ()
    # Prompt tokens after this chunk's (a back end may read a prompt's tail otherwise
    # when it knows how much of it is left, whatever the chunks).
    prompt_left: int = 0
    # A chat prompt's final message (a back end may read it otherwise, as long as it
    # reads it so whatever the chunks and whichever request read the prefix before it).
    tail: PromptTail | None = None


class StepFailedError(RuntimeError):
    """The back end could not run a step (no KV room, or a native error)."""


DecodeFailedError = StepFailedError  # the name the first contract used


class Sampler(Protocol):
    """One request's sampling state (its own random draws)."""

    # The last draw's log-probabilities, when ``SamplingParams.logprobs`` asked for them.
    last: TokenLogprob | None

    def close(self) -> None: ...


class Runtime(Protocol):
    """The KV of every session of one loaded model; only the engine thread touches it.

    Sessions are ids ``0..n_sessions-1``. The runtime owns what they hold: ``step``
    appends, ``truncate`` cuts, ``fork`` copies or aliases, ``truncate(s, 0)`` drops.
    """

    kv: KVFacts
    n_sessions: int
    max_batch: int  # tokens one step may feed across sessions
    # The longest ``Work.draft`` this runtime verifies exactly (0: it does not speculate).
    max_draft: int

    def step(self, work: Sequence[Work]) -> list[int | tuple[int, ...] | None]:
        """Feed every item's tokens in one pass (or as the back end runs them) and draw
        a token for each item with a sampler; return it per item (None without one; a
        tuple of draws for an item with a ``draft``).
        Raise :class:`StepFailedError` when the step cannot run: nothing is appended."""

    def propose(self, session: int, token: int) -> tuple[int, ...]:
        """The model's own draft head's guess at what follows ``token`` (``session``'s
        last draw, not yet fed). Called only where ``ModelInfo.draft_head`` is set."""

    def draft_room(self, session: int, draft: int) -> int:
        """How many of ``draft`` drafted tokens ``session``'s next step may verify on the
        attention path a plain decode row there would take (0: decode it plainly)."""

    def new_sampler(self, params: SamplingParams) -> Sampler: ...

    def truncate(self, session: int, keep: int) -> bool:
        """Keep the first ``keep`` tokens of ``session``; False (and nothing dropped) if
        it cannot rewind there (see ``kv.truncate``). ``keep=0`` always works."""

    def reachable(self, session: int, keep: int, tail: PromptTail | None = None) -> int:
        """The longest prefix of at most ``keep`` tokens ``session`` can be cut back to or
        forked at: ``keep`` itself where the cache cuts anywhere or holds exactly ``keep``
        tokens, the last state snapshot at or below it for recurrent state, else 0. A
        back end that reads a prompt's ``tail`` otherwise (``Work.tail``) may keep less:
        only the positions it read as a prompt with this ``tail`` reads them."""

    def fork(self, source: int, target: int, length: int) -> bool:
        """Make ``target`` hold the first ``length`` tokens of ``source``.

        False leaves ``target`` untouched (``kv.fork`` says what a fork costs)."""

    def save(self, session: int, length: int) -> object | None:
        """``session``'s cache of ``length`` tokens as host bytes, to :meth:`restore`
        later into any session; None where it cannot (``kv.saves`` false)."""

    def restore(self, session: int, saved: object, length: int) -> bool:
        """Make ``session`` hold the ``length`` tokens ``saved`` holds; False leaves it
        empty."""

    def restorable(self, saved: object, keep: int, tail: PromptTail | None = None) -> int:
        """The longest prefix of at most ``keep`` tokens a session restored from ``saved``
        can be cut back to (as :meth:`reachable` for a session: the last state snapshot
        it kept for recurrent state, else ``keep``; and as that reads ``tail``)."""

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


@attrs.frozen
class CheckpointFacts:
    """What a back end reads from a checkpoint without loading it."""

    architecture: str | None = None
    context_length: int | None = None  # trained context, if the checkpoint says
    # Why the checkpoint's own draft head (``--speculation mtp``) cannot run here, or
    # None when it can.
    no_draft_head: str | None = "the back end runs no draft head"


@attrs.frozen
class BackendOption:
    """A setting a back end owns: ``butter serve`` shows it as ``flag`` under the back
    end's name, checks it before anything loads, and ``create_runtime`` receives it as
    ``options[name]``; unset, it is absent and the back end uses ``default``."""

    name: str  # the key in ``create_runtime(options=...)``
    flag: str  # the ``butter serve`` flag, e.g. ``--ubatch-size``
    help: str
    parse: Callable[[str], object] = str  # text to value; raise ValueError to refuse
    choices: tuple[str, ...] = ()
    default: object = None  # what the back end uses when the option is unset (for --help)
    check: Callable[[object], str | None] = lambda value: None  # why a value cannot work

    @classmethod
    def count(cls, name: str, flag: str, help: str, *, maximum: int,
              default: object = None) -> BackendOption:
        """A whole number from 1 to ``maximum``."""

        def parse(text: str) -> int:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{text!r} is not an integer") from None
            if value < 1:
                raise ValueError(f"{text!r} must be at least 1")
            return value

        def check(value: object) -> str | None:
            return f"{value} is more than {maximum}" if int(value) > maximum else None

        return cls(name=name, flag=flag, help=help, parse=parse, check=check, default=default)


@attrs.frozen
class SessionLayout:
    """How a back end lays out sessions for ``parallel`` active ones and its options."""

    n_sessions: int = 0  # sessions the runtime holds; 0: the engine's (parallel + 2)
    streams: int = 1  # the KV budget splits into this many equal, private shares
    # Whether a session's cache can go to host memory and back (``--cache-ram``).
    prompt_cache: bool = False


@attrs.frozen
class BackendLimits:
    """What the native library allows; flags past it exit 2 naming the limit."""

    max_parallel: int | None = None  # active sessions at once
    max_threads: int | None = None  # CPU threads ``load(threads=N)`` takes
    context_granule: int = 1  # ``--max-context`` must be a multiple of it


class Backend(Protocol):
    name: str
    priority: int  # lower wins when several back ends can load a checkpoint
    options: tuple[BackendOption, ...]  # the settings ``create_runtime`` takes
    limits: BackendLimits
    takes_threads: bool  # whether ``load(threads=N)`` means something
    kv_windows: bool  # whether runtimes take ``KVSpec.window``
    decode_paths: frozenset[str]  # the ``KVSpec.decode_path`` values runtimes take

    def session_layout(self, options: Mapping[str, object], parallel: int) -> SessionLayout:
        """How ``parallel`` sessions are laid out with ``options`` (checked ones)."""

    def unavailable(self) -> str | None:
        """Why this back end cannot run here (a library missing), or None."""

    def can_load(self, resolved: ResolvedModel) -> bool: ...

    def precheck(self, resolved: ResolvedModel) -> CheckpointFacts:
        """Refuse, cheaply and before anything is freed, a checkpoint ``load`` would refuse
        from its structure; raise ``ModelLoadError`` with a reason naming no paths or sizes."""

    def kv_storage(self, codec: KVCodec) -> str | None:
        """How this back end stores ``codec`` (one line), or None if it serves it raw."""

    def load(self, resolved: ResolvedModel, *, threads: int | None = None) -> LoadedModel:
        """Load a checkpoint ``precheck`` passed; raise ``ModelLoadError`` with the loader's
        reason (no paths, no sizes) on failure."""


def snapshot_at_or_below(points: Iterable[tuple[int, object]], position: int) -> int:
    """The latest position not past ``position`` among a session's (or a saved cache's)
    state snapshots, ``(position, state)`` pairs (0: none)."""
    return max((at for at, _ in points if at <= position), default=0)


def check_options(backend: Backend, options: Mapping[str, object]) -> dict[str, object]:
    """``options`` if ``backend`` takes every one of them with these values; raise
    :class:`~butter.errors.InvalidRequestError` naming the first one it does not."""
    declared = {option.name: option for option in backend.options}
    for name, value in options.items():
        option = declared.get(name)
        if option is None:
            raise InvalidRequestError(f"The {backend.name} back end has no {name} setting.")
        if option.choices and value not in option.choices:
            raise InvalidRequestError(f"{option.flag} must be one of "
                                      f"{', '.join(option.choices)}.")
        reason = option.check(value)
        if reason is not None:
            raise InvalidRequestError(f"{option.flag}: {reason}.")
    return dict(options)
