"""A fake loaded model and runtime for scheduler unit tests (no native library).

The runtime keeps each session's tokens in a list, so a test sees exactly what the
engine fed, cut, forked and dropped. Every draw is ``next_token``; ``fail_when``
makes a step raise ``StepFailedError`` (nothing is appended, as the contract says).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from butter.backend import (
    ForkKind,
    KVFacts,
    KVSpec,
    ModelInfo,
    StepFailedError,
    TruncateKind,
    Work,
)


class FakeSampler:
    def __init__(self) -> None:
        self.closed = False
        self.last = None

    def close(self) -> None:
        self.closed = True


class FakeRuntime:
    def __init__(self, *, kv: KVSpec, capacity: int, n_sessions: int, max_batch: int,
                 options: dict, fork: ForkKind = ForkKind.ALIAS,
                 truncate: TruncateKind = TruncateKind.ANYWHERE) -> None:
        self.spec = kv
        self.kv = KVFacts(budget_bytes=capacity * 2, token_bytes=2, max_positions=capacity,
                          fork=fork, truncate=truncate)
        self.n_sessions = n_sessions
        self.max_batch = max_batch
        self.options = options
        self.held: list[list[int]] = [[] for _ in range(n_sessions)]
        self.steps: list[list[tuple[int, int]]] = []  # (session, tokens fed) per step
        self.forks: list[tuple[int, int, int]] = []
        self.next_token = 7
        self.fork_works = True
        self.fail_when: Callable[[Sequence[Work]], bool] = lambda work: False
        self.fail_with: BaseException | None = None  # raised as is (not a StepFailedError)
        self.delay = 0.0  # seconds each step takes, to keep a request busy

    def step(self, work: Sequence[Work]) -> list[int | None]:
        time.sleep(self.delay)
        if self.fail_with is not None:
            raise self.fail_with
        if self.fail_when(work):
            raise StepFailedError("scripted failure")
        self.steps.append([(item.session, len(item.tokens)) for item in work])
        for item in work:
            self.held[item.session].extend(item.tokens)
        return [self.next_token if item.sampler is not None else None for item in work]

    def new_sampler(self, params) -> FakeSampler:
        return FakeSampler()

    def truncate(self, session: int, keep: int) -> bool:
        if not self.kv.can_truncate(len(self.held[session]), keep):
            return False
        del self.held[session][keep:]
        return True

    def fork(self, source: int, target: int, length: int) -> bool:
        if self.kv.fork is ForkKind.NONE or not self.fork_works:
            return False
        self.held[target] = self.held[source][:length]
        self.forks.append((source, target, length))
        return True

    def describe(self) -> dict[str, object]:
        return {"fake": True}

    def close(self) -> None:
        pass


class FakeModel:
    """A loaded model whose runtime is a :class:`FakeRuntime` with the given kinds."""

    def __init__(self, *, fusable: bool = True, fork: ForkKind = ForkKind.ALIAS,
                 truncate: TruncateKind = TruncateKind.ANYWHERE) -> None:
        self.info = ModelInfo(architecture="fake", n_ctx_train=256, chat_template=None,
                              bos_token="", eos_token="", add_bos=False, fusable=fusable)
        self._kinds = {"fork": fork, "truncate": truncate}
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
