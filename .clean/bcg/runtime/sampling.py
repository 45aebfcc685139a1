"""Greedy first tokens: ``argmax`` over the vocabulary, in two stages where the vocabulary is large.

torch reduces one row of logits in one thread block: on a GPU a 128k vocabulary took 27 µs a prefill (the whole
LM head GEMM before it took 127). Split into chunks, the first stage is one block a chunk, the second a short row of
chunk maxima; both keep argmax's answer exactly, ties included, because ``max`` along a dimension and ``argmax`` both
return the first index of the maximum (NaN counting as the maximum), and the first chunk holding it holds its first
index.
"""

from __future__ import annotations

import functools

import torch  # noqa: F401  (the example's namespace)
from torch import Tensor

__all__ = ["greedy_tokens"]

_CHUNKS = (256, 128, 64, 32)  # chunk counts tried, most first
_MIN_CHUNK = 128  # shorter chunks would leave the first stage's blocks idle; below this the one-stage argmax is used


def greedy_tokens(logits: Tensor) -> Tensor:
    """``logits.argmax(dim=-1)`` for ``logits (rows, vocab)``, as int64 ``(rows,)``; two reductions when the
    vocabulary splits into at least 32 chunks of at least 128 logits, one otherwise.

    Example:
        >>> logits = torch.zeros(2, 32768); logits[0, 5] = logits[0, 9000] = 1.0; logits[1, -1] = 2.0
        >>> greedy_tokens(logits).tolist()      # the first of two equal maxima, as argmax
        [5, 32767]
    """
    rows, vocab = logits.shape
    chunks = _chunks(vocab)
    if chunks is None or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    size = vocab // chunks
    best, where = logits.view(rows, chunks, size).max(dim=-1)  # per chunk: the maximum and its first index
    chunk = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    # chunk * size + its index in the chunk, in one kernel (a short prompt's result waits for each of these)
    return where.gather(1, chunk).add_(chunk, alpha=size).squeeze(1)


@functools.cache
def _chunks(vocab: int) -> int | None:
    """The most chunks of at least ``_MIN_CHUNK`` logits that ``vocab`` splits into evenly (one model's vocabulary:
    asked at every prefill, worked out once)."""
    return next((c for c in _CHUNKS if vocab % c == 0 and vocab // c >= _MIN_CHUNK), None)
