"""What one ``llama_decode`` is built from: a request's sampler chain, the batch writer.

Imported only with ``llama_cpp`` (through :mod:`butter_backend_gguf.native`).
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp as ll
import numpy as np

from butter.backend import SamplingParams, StepFailedError
from butter.sampling import apply_mask, token_logprob

PENALTY_WINDOW = 4096  # generated tokens the penalties remember


class GGUFSampler:
    """One request's llama_sampler chain (own seed, own random draws), in llama-server's
    order: logit bias, penalties, then greedy or top-k, top-p, min-p, temperature and a
    draw. A grammar mask is written into the logits before the chain reads them.

    A chain of greedy alone is read straight off the logits: the first highest logit,
    the token llama.cpp's greedy sampler picks. The chain would first copy every one of
    the vocabulary's candidates (60 µs a row on SmolLM2's 49,152, ``bench/row_cost.py
    --draw``; the argmax takes 9), and a verify draws once per draft."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self.last = None
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.logit_bias:
            biases = (ll.llama_logit_bias * len(params.logit_bias))(
                *(ll.llama_logit_bias(token, bias) for token, bias in params.logit_bias))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_logit_bias(
                n_vocab, len(params.logit_bias), biases))
        if params.frequency_penalty or params.presence_penalty \
                or params.repetition_penalty != 1.0:
            # The chain sees only the tokens it drew: generated tokens are penalised, as
            # OpenAI's penalties are, never the prompt.
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
                n_vocab, PENALTY_WINDOW, params.repetition_penalty, params.frequency_penalty,
                params.presence_penalty))
        self.argmax = params.temperature <= 0.0 and ll.llama_sampler_chain_n(chain) == 0
        if params.temperature <= 0.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        self.chain = chain

    def sample(self, ctx, index: int, mask) -> int:
        """Draw from the logits of batch row ``index``, masked by ``mask`` if given."""
        raw = None
        if self.argmax or mask is not None or self.params.logprobs is not None:
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, index),
                                           shape=(self.n_vocab,))
            if self.params.logprobs is not None:
                raw = logits.copy() if mask is not None else logits
            if mask is not None:
                apply_mask(logits, mask)
        if self.argmax:
            token = int(logits.argmax())
        else:
            token = int(ll.llama_sampler_sample(self.chain, ctx, index))
        if raw is not None:
            self.last = token_logprob(raw, token, self.params.logprobs)
        return token

    def close(self) -> None:
        if self.chain is not None:
            ll.llama_sampler_free(self.chain)
            self.chain = None


class BatchBuilder:
    """A checked writer over one ``llama_batch``: capacity first, explicit positions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.batch = ll.llama_batch_init(capacity, 0, 1)
        self.n_tokens = 0

    def clear(self) -> None:
        self.n_tokens = 0

    def add(self, seq_id: int, tokens: Sequence[int], position: int, wants_logits: bool) -> int:
        """Write consecutive tokens of one sequence; return the batch index of the last."""
        count = len(tokens)
        if count == 0 or self.n_tokens + count > self.capacity:
            raise StepFailedError(
                f"batch overflow: {self.n_tokens} + {count} tokens > capacity {self.capacity}"
            )
        batch, start = self.batch, self.n_tokens
        for offset, token in enumerate(tokens):
            index = start + offset
            batch.token[index] = token
            batch.pos[index] = position + offset
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq_id
            batch.logits[index] = 0
        last = start + count - 1
        batch.logits[last] = 1 if wants_logits else 0
        self.n_tokens = start + count
        batch.n_tokens = self.n_tokens
        return last

    def close(self) -> None:
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
