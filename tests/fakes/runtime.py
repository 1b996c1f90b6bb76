"""A fake loaded model and runtime (no native library) that hold the engine to the contract.

:class:`FakeRuntime` keeps each session's tokens in a list, so a test sees exactly what
the engine fed, cut, forked and dropped. It enforces what ``butter.backend`` promises a
real runtime enforces, and fails loudly where the engine breaks the contract:

- a step feeds at most ``max_batch`` tokens, each item a session in ``0..n_sessions-1``
  at most once, with at least one token and an open sampler (else :class:`ContractError`:
  a bug in the caller, so the engine fails its requests instead of retrying in halves);
- a session holds at most ``kv.max_positions`` tokens and all sessions together at most
  ``kv.budget_bytes`` (an aliased fork shares its cells); a step past either raises
  ``StepFailedError`` and appends nothing, as a full KV cache does;
- ``fork`` refuses (False, target untouched) a length past what the source holds, a
  source that is its target, or a runtime that cannot fork.

Draws are ``next_token`` (scripted), or, with ``next_token=None``, from a toy language
model (:class:`ToyModel`): logits that depend on the whole context, drawn by
:class:`FakeSampler` through the sampling chain ``SamplingParams`` documents. The toy
model is the fake the conformance suite (:mod:`butter.testing`) runs on.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from butter.backend import (
    ForkKind,
    KVFacts,
    KVSpec,
    ModelInfo,
    SamplingParams,
    StepFailedError,
    TokenLogprob,
    TruncateKind,
    Work,
)


class ContractError(AssertionError):
    """The engine asked the runtime for something ``butter.backend`` does not allow."""


class FakeSampler:
    """One request's sampling state; ``sample`` applies ``SamplingParams`` in its order."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params
        self.closed = False
        self.last: TokenLogprob | None = None
        self.drawn: list[int] = []
        self._random = np.random.default_rng(params.seed if params else 0)

    def sample(self, logits: np.ndarray, mask: object | None) -> int:
        """Draw from ``logits`` (the model's): mask, bias, penalties, top-k, top-p, min-p,
        temperature, then this sampler's own random state (greedy at temperature 0)."""
        params = self.params or SamplingParams(temperature=0.0, top_p=1.0, seed=0)
        scores = logits.astype(np.float64)
        if mask is not None:
            bits = np.unpackbits(np.asarray(mask, dtype=np.int32).view(np.uint8),
                                 bitorder="little")[:len(scores)]
            scores[bits == 0] = -np.inf
        for token, bias in params.logit_bias:
            scores[token] += bias
        for token, count in Counter(self.drawn).items():
            scores[token] -= params.frequency_penalty * count + params.presence_penalty
            if params.repetition_penalty != 1.0:
                scores[token] = scores[token] / params.repetition_penalty \
                    if scores[token] > 0 else scores[token] * params.repetition_penalty
        if params.temperature <= 0:
            token = int(np.argmax(scores))
        else:
            token = self._draw(scores, params)
        self.drawn.append(token)
        if params.logprobs is not None:
            own = logits - np.logaddexp.reduce(logits)
            top = np.argsort(-own, kind="stable")[:params.logprobs]
            self.last = TokenLogprob(token, float(own[token]),
                                     tuple((int(t), float(own[t])) for t in top))
        return token

    def _draw(self, scores: np.ndarray, params: SamplingParams) -> int:
        order = np.argsort(-scores, kind="stable")
        order = order[np.isfinite(scores[order])]
        if params.top_k > 0:
            order = order[:params.top_k]
        probs = np.exp(scores[order] - scores[order[0]])
        probs /= probs.sum()
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        keep = min(keep, int((probs >= params.min_p * probs[0]).sum()))
        order = order[:max(keep, 1)]
        weights = np.exp((scores[order] - scores[order[0]]) / params.temperature)
        return int(self._random.choice(order, p=weights / weights.sum()))

    def close(self) -> None:
        self.closed = True


class FakeRuntime:
    """The KV of ``n_sessions`` sessions as token lists (see the module docstring)."""

    def __init__(self, *, kv: KVSpec, capacity: int, n_sessions: int, max_batch: int,
                 options: dict, fork: ForkKind = ForkKind.ALIAS,
                 truncate: TruncateKind = TruncateKind.ANYWHERE, saves: bool = False,
                 next_token: int | None = 7,
                 logits: Callable[[Sequence[int]], np.ndarray] | None = None) -> None:
        self.spec = kv
        self.kv = KVFacts(budget_bytes=capacity * 2, token_bytes=2, max_positions=capacity,
                          fork=fork, truncate=truncate, saves=saves)
        self.n_sessions = n_sessions
        self.max_batch = max_batch
        self.max_draft = 16  # drafts verify exactly here: each draw is the plain one
        self.verifies: list[tuple[int, tuple[int, ...], int]] = []  # session, draft, accepted
        self.options = options
        self.held: list[list[int]] = [[] for _ in range(n_sessions)]
        # Each held position's cell: an aliased fork shares its source's cells.
        self._cells: list[list[int]] = [[] for _ in range(n_sessions)]
        self._new_cell = itertools.count()
        self.steps: list[list[tuple[int, int]]] = []  # (session, tokens fed) per step
        self.forks: list[tuple[int, int, int]] = []
        self.restores: list[tuple[int, int]] = []  # session, length
        self.next_token = next_token  # every draw; None: the toy model's ``logits``
        self.logits = logits
        self.fork_works = True
        self.fail_when: Callable[[Sequence[Work]], bool] = lambda work: False
        self.fail_with: BaseException | None = None  # raised as is (not a StepFailedError)
        self.delay = 0.0  # seconds each step takes, to keep a request busy

    def step(self, work: Sequence[Work]) -> list[int | tuple[int, ...] | None]:
        self._check(work)
        time.sleep(self.delay)
        if self.fail_with is not None:
            raise self.fail_with
        if self.fail_when(work):
            raise StepFailedError("scripted failure")
        self._check_room(work)
        self.steps.append([(item.session, len(item.tokens)) for item in work])
        drawn: list[int | tuple[int, ...] | None] = []
        for item in work:
            if item.draft:
                drawn.append(self._verify(item))
                continue
            self.held[item.session].extend(item.tokens)
            self._cells[item.session].extend(next(self._new_cell) for _ in item.tokens)
            drawn.append(None if item.sampler is None else self._draw(item))
        return drawn

    def _verify(self, item: Work) -> tuple[int, ...]:
        """Feed the last token and the drafts one at a time, drawing after each exactly as
        a plain step would, until a draw differs from the next draft."""
        if item.sampler is None or item.mask is not None \
                or tuple(item.tokens[1:]) != item.draft or len(item.draft) > self.max_draft:
            raise ContractError(f"a malformed verify: {item}")
        draws: list[int] = []
        for index, token in enumerate(item.tokens):
            self.held[item.session].append(token)
            self._cells[item.session].append(next(self._new_cell))
            draws.append(self._draw(item))
            if index == len(item.draft) or draws[-1] != item.draft[index]:
                break
        self.verifies.append((item.session, item.draft, len(draws) - 1))
        return tuple(draws)

    def draft_room(self, session: int, draft: int) -> int:
        return min(draft, self.max_draft)

    def _check(self, work: Sequence[Work]) -> None:
        sessions = [item.session for item in work]
        if not work:
            raise ContractError("a step with no work")
        if any(not 0 <= s < self.n_sessions for s in sessions):
            raise ContractError(f"sessions {sessions} outside 0..{self.n_sessions - 1}")
        if len(set(sessions)) != len(sessions):
            raise ContractError(f"a session twice in one step: {sessions}")
        if any(not item.tokens for item in work):
            raise ContractError("an item with no tokens")
        fed = sum(len(item.tokens) for item in work)
        if fed > self.max_batch:
            raise ContractError(f"a step of {fed} tokens; max_batch is {self.max_batch}")
        if any(item.sampler is not None and item.sampler.closed for item in work):
            raise ContractError("a draw from a closed sampler")

    def _check_room(self, work: Sequence[Work]) -> None:
        for item in work:
            if len(self.held[item.session]) + len(item.tokens) > self.kv.max_positions:
                raise StepFailedError(f"session {item.session} would pass "
                                      f"{self.kv.max_positions} positions")
        cells = len({cell for held in self._cells for cell in held})
        fed = sum(len(item.tokens) for item in work)
        if (cells + fed) * self.kv.token_bytes > self.kv.budget_bytes:
            raise StepFailedError(f"no KV room: {cells} cells held, {fed} more fed")

    def _draw(self, item: Work) -> int:
        if self.next_token is not None:
            return self.next_token
        assert self.logits is not None, "next_token=None needs a toy model's logits"
        return item.sampler.sample(self.logits(self.held[item.session]), item.mask)

    def new_sampler(self, params: SamplingParams) -> FakeSampler:
        return FakeSampler(params)

    def truncate(self, session: int, keep: int) -> bool:
        if not self.kv.can_truncate(len(self.held[session]), keep):
            return False
        del self.held[session][keep:]
        del self._cells[session][keep:]
        return True

    def reachable(self, session: int, keep: int, tail=None) -> int:
        length = len(self.held[session])
        return min(keep, length) if self.kv.can_truncate(length, keep) else 0

    def fork(self, source: int, target: int, length: int) -> bool:
        if not (0 <= source < self.n_sessions and 0 <= target < self.n_sessions):
            raise ContractError(f"fork({source}, {target}) outside 0..{self.n_sessions - 1}")
        if self.kv.fork is ForkKind.NONE or not self.fork_works or source == target \
                or length > len(self.held[source]):
            return False
        self.held[target] = self.held[source][:length]
        self._cells[target] = self._cells[source][:length] if self.kv.fork is ForkKind.ALIAS \
            else [next(self._new_cell) for _ in range(length)]
        self.forks.append((source, target, length))
        return True

    def save(self, session: int, length: int) -> list[int] | None:
        held = self.held[session]
        return list(held) if self.kv.saves and len(held) == length else None

    def restore(self, session: int, saved: list[int], length: int) -> bool:
        self.restores.append((session, length))
        self.held[session] = list(saved[:length])
        self._cells[session] = [next(self._new_cell) for _ in range(length)]
        return True

    def restorable(self, saved: list[int], keep: int, tail=None) -> int:
        return min(keep, len(saved))

    def describe(self) -> dict[str, object]:
        return {"fake": True}

    def close(self) -> None:
        pass


class FakeModel:
    """A loaded model whose runtime is a :class:`FakeRuntime` with the given kinds; its
    runtime draws ``next_token`` every time (7: each piece is ``b"x"``)."""

    def __init__(self, *, fusable: bool = True, fork: ForkKind = ForkKind.ALIAS,
                 truncate: TruncateKind = TruncateKind.ANYWHERE, saves: bool = False) -> None:
        self.info = ModelInfo(architecture="fake", n_ctx_train=256, chat_template=None,
                              bos_token="", eos_token="", add_bos=False, fusable=fusable)
        self._kinds = {"fork": fork, "truncate": truncate, "saves": saves}
        self.runtime: FakeRuntime | None = None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [ord(c) for c in text]

    def token_piece(self, token: int) -> bytes:
        return b"x"

    def is_end_of_generation(self, token: int) -> bool:
        return False

    def create_runtime(self, **options) -> FakeRuntime:
        self.runtime = FakeRuntime(**options, **self._kinds)
        return self.runtime

    def close(self) -> None:
        pass


# ---- a toy language model over bytes -------------------------------------------------

CONTROL_TOKENS = ("<|turn|>", "<|end|>")  # ids 256 and 257; <|end|> ends a turn
TOY_TEMPLATE = (
    "{% for message in messages %}{{ '<|turn|>' + message['role'] + '\n' + "
    "message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn|>assistant\n' }}{% endif %}"
)
# Tokens the toy model leans to: greedy text repeats them unless penalties push it off.
FAVOURITES = tuple(b"lmno")


class ToyModel(FakeModel):
    """A byte-level toy language model: tokens 0-255 are bytes, 256 and 257 the control
    tokens. Its logits are a deterministic function of everything a session holds (so a
    fork or a cut that held the wrong tokens answers differently), leaning to a few
    favourite letters. The conformance suite's fake: nothing in it is scripted."""

    N_VOCAB = 256 + len(CONTROL_TOKENS)

    def __init__(self, *, delay: float = 0.0) -> None:
        super().__init__()
        self.info = ModelInfo(architecture="toy", n_ctx_train=4096, chat_template=TOY_TEMPLATE,
                              bos_token="", eos_token="<|end|>", add_bos=False,
                              control_tokens=CONTROL_TOKENS, n_vocab=self.N_VOCAB)
        self.delay = delay

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tokens: list[int] = []
        rest = text
        while rest:
            control = next((c for c in CONTROL_TOKENS if rest.startswith(c)), None) \
                if parse_special else None
            if control is not None:
                tokens.append(256 + CONTROL_TOKENS.index(control))
                rest = rest[len(control):]
            else:
                tokens.extend(rest[0].encode())
                rest = rest[1:]
        return tokens

    def token_piece(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else CONTROL_TOKENS[token - 256].encode()

    def is_end_of_generation(self, token: int) -> bool:
        return token == 257

    @classmethod
    def logits(cls, context: Sequence[int]) -> np.ndarray:
        """The next token's logits after ``context``."""
        seed = zlib.crc32(np.asarray(context, dtype=np.int64).tobytes())
        logits = np.random.default_rng(seed).normal(size=cls.N_VOCAB).astype(np.float32)
        logits[list(FAVOURITES)] += 4.0
        return logits

    def create_runtime(self, **options) -> FakeRuntime:
        self.runtime = FakeRuntime(**options, **self._kinds, next_token=None,
                                   logits=self.logits)
        self.runtime.delay = self.delay
        return self.runtime
