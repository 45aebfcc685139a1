"""Packing the new tokens of several prefill requests into one token dimension."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from bcg.ops.attention import BatchContext
from bcg.ops.kv_cache import KVPool


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

    @classmethod
    def unchecked(cls, token_ids: Tensor, new_slots: Tensor, prefix_len: int, prefix_slots: Tensor) -> PrefillItem:
        """An item from CPU int64 1-D tensors of matching lengths, without normalising or checking them.

        For callers that have already validated their inputs (the engine builds one item per request per
        prefill, on the host's critical path). Anything else should call the constructor.
        """
        item = cls.__new__(cls)
        item.token_ids, item.new_slots = token_ids, new_slots
        item.prefix_len, item.prefix_slots = prefix_len, prefix_slots
        return item

    @property
    def num_new_tokens(self) -> int:
        """Number of new tokens."""
        return self.token_ids.numel()


class PrefillBatch:
    """The new tokens of several requests packed back to back, plus their KV bookkeeping.

    All device tensors come from a single host-to-device copy (pinned and non-blocking on CUDA).

    Attributes:
        input_ids: int64 ``(num_tokens,)`` on the pool's device.
        positions: int64 ``(num_tokens,)``, ``prefix_len + arange(n)`` per request.
        logits_indices: int64 ``(num_requests,)``, row of each request's last new token.
        seq_lens_q, prefix_lens: per-request host ints; has_prefix: whether any request has a cached prefix.

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
        self.num_tokens = total = sum(self.seq_lens_q)
        # Host metadata in numpy: this runs before every forward while the GPU may sit idle, and numpy's per-call
        # cost is a fraction of torch's on CPU tensors. Nothing here grows per request except the concatenations.
        seq_q = np.array(self.seq_lens_q, dtype=np.int64)
        prefix = np.array(self.prefix_lens, dtype=np.int64)
        cu_q = np.zeros(len(items) + 1, dtype=np.int64)
        cu_k = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(seq_q, out=cu_q[1:])
        np.cumsum(seq_q + prefix, out=cu_k[1:])
        positions = np.arange(total, dtype=np.int64) + np.repeat(prefix - cu_q[:-1], seq_q)
        write_slots = np.concatenate([item.new_slots.numpy() for item in items])
        has_prefix = any(self.prefix_lens)
        read_slots = (np.concatenate([s.numpy() for item in items for s in (item.prefix_slots, item.new_slots)])
                      if has_prefix else write_slots)
        check_slots(read_slots, kv_pool.num_slots)
        # cu_seqlens are int32 on the device: pack them as int32 pairs reinterpreted as int64, so one transfer
        # carries everything and no cast kernel runs on the device.
        cu32 = np.concatenate([cu_q, cu_k]).astype(np.int32)
        if cu32.size % 2:
            cu32 = np.append(cu32, np.int32(0))
        parts = [np.concatenate([item.token_ids.numpy() for item in items]), positions, write_slots,
                 read_slots if has_prefix else write_slots[:0], cu_q[1:] - 1, cu32.view(np.int64)]
        packed = torch.from_numpy(np.concatenate(parts))
        if kv_pool.device.type == "cuda":
            # Pinned and non-blocking: a pageable copy would make the host wait for the GPU's queued work.
            packed = packed.pin_memory().to(kv_pool.device, non_blocking=True)
        (self.input_ids, self.positions, self.write_slots, read, self.logits_indices, cu) = packed.split(
            [p.size for p in parts])
        self.read_slots = read if has_prefix else self.write_slots
        cu = cu.view(torch.int32)
        self.cu_seqlens_q, self.cu_seqlens_k = cu[: len(items) + 1], cu[len(items) + 1 : 2 * len(items) + 2]
        self.max_seqlen_q = max(self.seq_lens_q)
        self.max_seqlen_k = int((seq_q + prefix).max())
        self.has_prefix = has_prefix

    @property
    def num_requests(self) -> int:
        """Number of requests in the batch."""
        return len(self.seq_lens_q)

    def to_context(self, num_padded_tokens: int) -> BatchContext:
        """The live forward context for running this batch padded to ``num_padded_tokens`` rows."""
        return BatchContext(
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


def check_slots(slots: Tensor | np.ndarray, num_slots: int) -> None:
    """Raise ``ValueError`` if any slot is outside ``[0, num_slots)`` or used twice.

    The scratch slot (``num_slots``) is rejected too: it belongs to no request.
    """
    slots = slots.numpy() if isinstance(slots, Tensor) else slots
    if slots.size == 0:
        return
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        raise ValueError(f"KV slot out of range [0, {num_slots}) (the scratch slot is not allocatable)")
    if np.unique(slots).size != slots.size:
        raise ValueError("a KV slot appears twice in the batch")
