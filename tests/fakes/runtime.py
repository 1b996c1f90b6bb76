"""A fake loaded model and runtime for scheduler unit tests (no native library).

Every pass "decodes" by returning one output per entry that wants logits; every
sample is ``next_token``. ``fail_with`` makes the next pass raise it.
"""

from __future__ import annotations

from butter.backend import ModelInfo

INFO = ModelInfo(architecture="fake", n_ctx_train=256, chat_template=None, bos_token="",
                 eos_token="", add_bos=False)


class FakeSampler:
    def close(self) -> None:
        pass


class FakeRuntime:
    def __init__(self, *, capacity: int, n_sessions: int, max_batch: int,
                 micro_batch: int | None = None) -> None:
        self.capacity = capacity
        self.n_sessions = n_sessions
        self.max_batch = max_batch
        self.micro_batch = micro_batch or 63
        self.next_token = 7
        self.fail_with: BaseException | None = None
        self.passes = 0

    def decode(self, entries) -> list[int]:
        self.passes += 1
        if self.fail_with is not None:
            raise self.fail_with
        return [i for i, entry in enumerate(entries) if entry.wants_logits]

    def new_sampler(self, params) -> FakeSampler:
        return FakeSampler()

    def sample(self, sampler, output_index: int) -> int:
        return self.next_token

    def forget(self, seq_id: int, start: int) -> bool:
        return True

    def share(self, source_seq: int, target_seq: int, length: int) -> bool:
        return True

    def close(self) -> None:
        pass


class FakeModel:
    info = INFO

    def __init__(self) -> None:
        self.runtime: FakeRuntime | None = None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [ord(c) for c in text]

    def token_piece(self, token: int) -> bytes:
        return b"x"

    def is_end_of_generation(self, token: int) -> bool:
        return False

    def create_runtime(self, **options) -> FakeRuntime:
        self.runtime = FakeRuntime(**options)
        return self.runtime

    def close(self) -> None:
        pass
