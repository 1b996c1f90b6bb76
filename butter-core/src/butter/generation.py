"""What a client asks of one generation, and what it cost: the records the request
surface (``chat/``, ``wire/``) and the engine share, so neither imports the other's."""

from __future__ import annotations

import attrs


@attrs.frozen
class GenerationParams:
    """What the client asked for, already validated."""

    max_tokens: int | None = None  # None: the documented default (see admission)
    temperature: float = 0.8
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 40  # llama-server's default; 0 turns it off
    frequency_penalty: float = 0.0  # OpenAI's: minus count x penalty, over generated tokens
    presence_penalty: float = 0.0  # minus the penalty once a token has been generated
    repetition_penalty: float = 1.0  # vLLM's / llama.cpp's multiplicative penalty
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias -100..100)
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest; 0: off
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k best
    speculation: bool = True  # False: never draft (``speculation: false``); same tokens

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0)


@attrs.frozen
class TokenChoice:
    """A token as a client reads it: its text, its bytes and its log-probability."""

    token: str
    bytes: bytes
    logprob: float


@attrs.frozen
class Logprob:
    """One generated token's log-probability and the most likely alternatives."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


@attrs.frozen
class LogprobsDelta:
    """The log-probabilities of the tokens behind the text deltas that follow it."""

    entries: tuple[Logprob, ...]


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Speculation (prompt lookup): drafted tokens that became completion tokens, and
    # drafted tokens a verify turned down (OpenAI's ``completion_tokens_details`` names).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
