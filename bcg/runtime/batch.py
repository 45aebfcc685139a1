"""Packing the new tokens of several prefill requests into one token dimension."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from bcg.runtime.context import ForwardContext
from bcg.runtime.kv_cache import KVPool


def _as_cpu_long(values: Sequence[int] | Tensor) -> Tensor:
    if isinstance(values, Tensor):
        if values.dtype == torch.int64 and values.device.type == "cpu" and values.dim() == 1:
            return values  # the engine's common case: no conversion ops on the host's hot path
        return values.detach().to("cpu", torch.int64).flatten()
    return torch.tensor(list(values), dtype=torch.int64)


@dataclass
class PrefillItem:
    """One request's share of a prefill batch.

    Attributes:
        token_ids: the new tokens to run (at least one).
        new_slots: pool slots for the new tokens, one each.
        prefix_len: tokens of this request already in the KV pool.
        prefix_slots: the slots holding those ``prefix_len`` tokens, in position order.

    All are normalised to CPU ``int64`` tensors.

    Example:
        >>> item = PrefillItem([5, 6], new_slots=[7, 8], prefix_len=1, prefix_slots=[3])
        >>> item.num_new_tokens
        2
    """

    token_ids: Sequence[int] | Tensor
    new_slots: Sequence[int] | Tensor
    prefix_len: int = 0
    prefix_slots: Sequence[int] | Tensor = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = _as_cpu_long(self.token_ids)
        self.new_slots = _as_cpu_long(self.new_slots)
        self.prefix_slots = _as_cpu_long(self.prefix_slots)
        if self.token_ids.numel() == 0:
            raise ValueError("a prefill item needs at least one new token")
        if self.new_slots.numel() != self.token_ids.numel():
            raise ValueError(f"{self.token_ids.numel()} new tokens but {self.new_slots.numel()} new slots")
        if self.prefix_slots.numel() != self.prefix_len:
            raise ValueError(f"prefix_len={self.prefix_len} but {self.prefix_slots.numel()} prefix slots")

    @property
    def num_new_tokens(self) -> int:
        """Number of new tokens."""
        return self.token_ids.numel()


class PrefillBatch:
    """The new tokens of several requests packed back to back, plus their KV bookkeeping.

    All device tensors come from a single host-to-device copy.

    Attributes:
        input_ids: int64 ``(num_tokens,)`` on the pool's device.
        positions: int64 ``(num_tokens,)``, ``prefix_len + arange(n)`` per request.
        logits_indices: int64 ``(num_requests,)``, row of each request's last new token.
        seq_lens_q, prefix_lens: per-request host ints.

    Example:
        >>> pool = KVPool(num_slots=16, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> batch = PrefillBatch([PrefillItem([1, 2, 3], pool.alloc(3)), PrefillItem([4], pool.alloc(1))], pool)
        >>> batch.positions.tolist(), batch.logits_indices.tolist()
        ([0, 1, 2, 0], [2, 3])
        >>> batch.to_context(num_padded_tokens=8).cu_seqlens_q.tolist()
        [0, 3, 4]
    """

    def __init__(self, items: Sequence[PrefillItem], kv_pool: KVPool) -> None:
        if not items:
            raise ValueError("a prefill batch needs at least one item")
        self.kv_pool = kv_pool
        self.seq_lens_q = [item.num_new_tokens for item in items]
        self.prefix_lens = [item.prefix_len for item in items]
        self.num_tokens = sum(self.seq_lens_q)
        seq_lens_q = torch.tensor(self.seq_lens_q)
        seq_lens_k = seq_lens_q + torch.tensor(self.prefix_lens)
        cu_seqlens_q = torch.nn.functional.pad(seq_lens_q.cumsum(0), (1, 0))
        cu_seqlens_k = torch.nn.functional.pad(seq_lens_k.cumsum(0), (1, 0))
        # prefix_len + (row - first row of its request), vectorised: host time per batch must not grow per request.
        total = self.num_tokens
        positions = (torch.arange(total) + (torch.tensor(self.prefix_lens) - cu_seqlens_q[:-1])
                     .repeat_interleave(seq_lens_q, output_size=total))
        write_slots = torch.cat([item.new_slots for item in items])
        read_slots = torch.cat([s for item in items for s in (item.prefix_slots, item.new_slots)])
        check_slots(read_slots, kv_pool.num_slots)
        # One packed host buffer -> one transfer; the fields below are views into it.
        parts = [
            torch.cat([item.token_ids for item in items]), positions, write_slots, read_slots,
            cu_seqlens_q[1:] - 1, cu_seqlens_q, cu_seqlens_k,
        ]
        packed = torch.cat(parts).to(kv_pool.device)
        (self.input_ids, self.positions, self.write_slots, self.read_slots, self.logits_indices,
         cu_q, cu_k) = packed.split([p.numel() for p in parts])
        self.cu_seqlens_q, self.cu_seqlens_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        self.max_seqlen_q = max(self.seq_lens_q)
        self.max_seqlen_k = int(seq_lens_k.max())

    @property
    def num_requests(self) -> int:
        """Number of requests in the batch."""
        return len(self.seq_lens_q)

    def to_context(self, num_padded_tokens: int) -> ForwardContext:
        """The :class:`ForwardContext` for running this batch padded to ``num_padded_tokens`` rows."""
        return ForwardContext(
            num_tokens=self.num_tokens,
            num_padded_tokens=num_padded_tokens,
            seq_lens_q=self.seq_lens_q,
            prefix_lens=self.prefix_lens,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            write_slots=self.write_slots,
            read_slots=self.read_slots,
            kv_pool=self.kv_pool,
        )


def check_slots(slots: Tensor, num_slots: int) -> None:
    """Raise ``ValueError`` if any slot is outside ``[0, num_slots)`` or used twice.

    The scratch slot (``num_slots``) is rejected too: it belongs to no request.
    """
    if slots.numel() == 0:
        return
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        raise ValueError(f"KV slot out of range [0, {num_slots}) (the scratch slot is not allocatable)")
    if slots.unique().numel() != slots.numel():
        raise ValueError("a KV slot appears twice in the batch")
