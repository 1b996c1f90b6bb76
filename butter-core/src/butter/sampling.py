"""Logit arithmetic every back end shares: applying a grammar's token mask and reading
log-probabilities off a row of logits. Rows are numpy float32 arrays."""

from __future__ import annotations

import numpy as np

from butter.backend import TokenLogprob


def allowed_tokens(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """The packed int32 bitmask ``mask`` (see ``Work.mask``) as ``n_vocab`` booleans.

    Tokens past the mask's end (a checkpoint whose logits outnumber its vocabulary) are
    not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8),
                         bitorder="little").astype(bool)
    if bits.shape[0] >= n_vocab:
        return bits[:n_vocab]
    return np.concatenate([bits, np.zeros(n_vocab - bits.shape[0], dtype=bool)])


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> None:
    """Set the logits of every token ``mask`` does not allow to -inf, in place."""
    logits[~allowed_tokens(mask, logits.shape[0])] = -np.inf


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under the softmax of ``logits``, and the ``top`` most
    likely tokens' (most likely first)."""
    row = logits.astype(np.float64, copy=False)
    peak = float(row.max())
    log_total = peak + float(np.log(np.exp(row - peak).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        count = min(top, row.shape[0])
        ids = np.argpartition(-row, count - 1)[:count]
        ids = ids[np.argsort(-row[ids], kind="stable")]
        best = tuple((int(t), float(row[t]) - log_total) for t in ids)
    return TokenLogprob(token=token, logprob=float(row[token]) - log_total, top=best)
