"""Feeding a prompt to a runtime in chunks, as the engine cuts them, for tests that hold
a read to the bit wherever it is cut."""

from __future__ import annotations

from collections.abc import Sequence

from butter.backend import PromptTail, SamplingParams, Work


def read_from(runtime, session: int, tokens: list[int], cuts: Sequence[int], start: int,
              answer: int = 4, tail: PromptTail | None = None) -> list:
    """Feed ``tokens[start:]`` into ``session`` in chunks ending at ``cuts`` and multiples
    of 256 (as the engine cuts them), ``tail`` its final message, draw ``answer`` greedy
    tokens; return every draw's log-probabilities."""
    sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0,
                                                 logprobs=5))
    try:
        ends = sorted(e for e in {*cuts, *range(256, len(tokens), 256), len(tokens)}
                      if e > start)
        drawn = []
        for end in ends:
            last = end == len(tokens)
            (token,) = runtime.step([Work(session, tokens[start:end],
                                          sampler if last else None,
                                          prompt_left=len(tokens) - end, tail=tail)])
            start = end
        drawn.append(sampler.last)
        while len(drawn) < answer:
            (token,) = runtime.step([Work(session, (token,), sampler)])
            drawn.append(sampler.last)
        return drawn
    finally:
        sampler.close()
