"""The live batch metadata that eager islands read during a forward pass.

The captured part of a forward pass sees only fixed-shape tensors; everything that changes from
batch to batch (the real token count, request boundaries, KV slots) lives in a
:class:`ForwardContext` that the runner installs with :func:`forward_context` around each replay.
Islands fetch it with :func:`get_forward_context`. A ``ContextVar`` (not a global) keeps
concurrent forwards on different threads apart.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from bcg.runtime.kv_cache import KVPool


@dataclass(frozen=True)
class ForwardContext:
    """Metadata of one packed prefill batch, as seen by the attention islands.

    Request ``r`` has ``seq_lens_q[r]`` new tokens after ``prefix_lens[r]`` cached ones; its new
    tokens occupy rows ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]`` of the packed token dimension and
    its full key range (prefix then new) is ``read_slots[cu_seqlens_k[r]:cu_seqlens_k[r + 1]]``.
    Usually built by :meth:`bcg.runtime.batch.PrefillBatch.to_context`.

    Attributes:
        num_tokens: real new tokens in the batch (rows ``[:num_tokens]`` are real).
        num_padded_tokens: rows the layer stack runs on (the captured bucket size).
        seq_lens_q: new tokens per request (host ints).
        prefix_lens: tokens already in the KV pool per request (host ints).
        cu_seqlens_q: int32 ``(R + 1,)`` on device, prefix sums of ``seq_lens_q``.
        cu_seqlens_k: int32 ``(R + 1,)`` on device, prefix sums of ``prefix_lens + seq_lens_q``.
        max_seqlen_q: longest ``seq_lens_q``.
        max_seqlen_k: longest key range.
        write_slots: int64 ``(num_tokens,)`` on device, pool slot of each real new token.
        read_slots: int64 ``(sum of key ranges,)`` on device, each request's prefix slots then its
            new slots, concatenated in request order.
        kv_pool: the pool the islands read and write.

    Example:
        >>> import torch
        >>> from bcg.runtime.kv_cache import KVPool
        >>> pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> cu = torch.tensor([0, 3], dtype=torch.int32)
        >>> ctx = ForwardContext(3, 4, [3], [0], cu, cu, 3, 3, torch.arange(3), torch.arange(3), pool)
        >>> with forward_context(ctx):
        ...     get_forward_context().num_padded_tokens
        4
    """

    num_tokens: int
    num_padded_tokens: int
    seq_lens_q: list[int]
    prefix_lens: list[int]
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    write_slots: Tensor
    read_slots: Tensor
    kv_pool: KVPool

    def __post_init__(self) -> None:
        if not 0 < self.num_tokens <= self.num_padded_tokens:
            raise ValueError(
                f"need 0 < num_tokens <= num_padded_tokens, got num_tokens={self.num_tokens}, "
                f"num_padded_tokens={self.num_padded_tokens}"
            )

    @property
    def num_requests(self) -> int:
        """Number of requests packed in the batch."""
        return len(self.seq_lens_q)

    @property
    def seq_lens_k(self) -> list[int]:
        """Key range length (prefix + new) per request."""
        return [p + q for p, q in zip(self.prefix_lens, self.seq_lens_q)]

    @functools.cached_property
    def has_prefix(self) -> bool:
        """Whether any request continues from cached tokens (computed once; islands ask every layer)."""
        return any(self.prefix_lens)


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("bcg_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install ``ctx`` as the current forward context for the duration of the ``with`` block.

    Nests: the previous context (if any) is restored on exit.

    Example:
        >>> with forward_context(ctx):  # doctest: +SKIP
        ...     hidden = model.forward_layers(hidden, positions)
    """
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """Return the current forward context.

    Raises:
        RuntimeError: no context is installed (an island ran outside ``forward_context``).
    """
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "no ForwardContext is set: run the model's forward_layers inside "
            "`with bcg.runtime.context.forward_context(ctx):` (the runner does this for each batch)"
        )
    return ctx
