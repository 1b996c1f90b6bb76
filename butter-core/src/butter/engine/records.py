"""One record per live request and one per session; the engine thread owns both."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

import attrs

from butter.backend import PromptTail, Sampler, SamplingParams
from butter.engine.events import Channel
from butter.engine.text import Detokenizer, StopMatcher
from butter.generation import GenerationParams, Logprob

if TYPE_CHECKING:
    from butter.engine.constraint import Constraint
    from butter.engine.speculation import Drafter

_request_ids = itertools.count(1)


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@attrs.define(slots=True, eq=False)
class Session:
    """One sequence id in the shared KV, and the tokens its cache holds."""

    seq_id: int
    tokens: list[int] = attrs.field(factory=list)
    last_used: float = 0.0
    request: Request | None = None

    @property
    def idle(self) -> bool:
        return self.request is None


@attrs.define(slots=True, eq=False)
class Request:
    """A live generation request, from submission until its last event."""

    prompt: list[int]  # token ids, encoded off the engine thread
    params: GenerationParams
    channel: Channel
    constraint: Constraint | None = None  # a grammar its tokens must follow
    tail: PromptTail | None = None  # a chat prompt's final message (``Work.tail``)
    id: int = attrs.field(factory=lambda: next(_request_ids))
    submitted_at: float = attrs.field(factory=time.monotonic)
    # Set from any thread; the engine acts on it at the next bounded work unit.
    cancelled: bool = False

    # Engine-thread state below.
    phase: Phase = Phase.QUEUED
    prompt_tokens: list[int] = attrs.field(factory=list)
    max_tokens: int = 0
    reservation: int = 0  # KV cells promised to this request (prompt + decode)
    session: Session | None = None
    cached_tokens: int = 0
    next_prefill: int = 0  # index into prompt_tokens of the next token to prefill
    generated: list[int] = attrs.field(factory=list)
    last_token: int | None = None
    last_token_at: float = 0.0  # time.monotonic() when last_token was sampled
    sampler: Sampler | None = None
    sampling: SamplingParams | None = None
    detokenizer: Detokenizer = attrs.field(factory=Detokenizer)
    stops: StopMatcher | None = None
    logprobs: list[Logprob] = attrs.field(factory=list)  # drawn, not yet sent
    drafter: Drafter | None = None  # prompt lookup, when this request speculates
    accepted_tokens: int = 0  # drafted tokens that became completion tokens
    rejected_tokens: int = 0  # drafted tokens a verify turned down
