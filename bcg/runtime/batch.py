"""Packing the new tokens of several prefill requests into one token dimension."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
from torch import Tensor

from bcg.ops.attention import AttentionBackend, attention_backend, default_attention_backend
from bcg.ops.context import ForwardContext
from bcg.ops.kv_cache import KVPool, run_starts
from bcg.ops.staging import Layout, Staged


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
    """The new tokens of several requests packed back to back, plus their KV bookkeeping, on the host.

    Everything is numpy (the ``host_*`` arrays): this runs before every forward while the GPU may sit idle, and
    numpy's per-call cost is a fraction of torch's on CPU tensors. The runner stages these arrays into its static
    fields and moves them to the device in one copy (:mod:`bcg.runtime.runner.inputs`); :meth:`to_context` and the
    device attributes below do the same for tools and tests that run a batch by hand.

    Args:
        items: the requests' shares, in order.
        kv_pool: the pool their slots belong to.
        logit_requests: the requests whose last token's logits are wanted (default: all); a chunk that does not end
            its request wants none.
        check: verify that every slot is in the pool's range and used once (the planner, whose slots come from the
            pool or a reservation of it, skips it and builds its batches with :meth:`from_arrays`).

    Attributes:
        num_tokens, num_requests, seq_lens_q, prefix_lens, has_prefix, max_seqlen_q, max_seqlen_k: host values.
        host_input_ids, host_positions (``prefix_len + arange(n)`` per request), host_write_slots, host_read_slots
        (each request's prefix slots then its new slots), host_cu_seqlens_q, host_cu_seqlens_k, host_logit_rows
        (the row of each wanted request's last token), host_run_starts (made on first use): numpy int64 arrays.

    Example:
        >>> pool = KVPool(num_slots=16, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> batch = PrefillBatch([PrefillItem([1, 2, 3], pool.alloc(3)), PrefillItem([4], pool.alloc(1))], pool)
        >>> batch.host_positions.tolist(), batch.host_logit_rows.tolist()
        ([0, 1, 2, 0], [2, 3])
        >>> batch.to_context(num_padded_tokens=8).cu_seqlens_q.tolist()
        [0, 3, 4]
    """

    def __init__(self, items: Sequence[PrefillItem], kv_pool: KVPool, logit_requests: Sequence[int] | None = None,
                 check: bool = True) -> None:
        if not items:
            raise ValueError("a prefill batch needs at least one item")
        seq_lens_q = [item.num_new_tokens for item in items]
        prefix_lens = [item.prefix_len for item in items]
        input_ids = (items[0].token_ids.numpy() if len(items) == 1
                     else np.concatenate([item.token_ids.numpy() for item in items]))
        write = (items[0].new_slots.numpy() if len(items) == 1
                 else np.concatenate([item.new_slots.numpy() for item in items]))
        read = (np.concatenate([s.numpy() for item in items for s in (item.prefix_slots, item.new_slots)])
                if any(prefix_lens) else None)
        self._fill(kv_pool, input_ids, write, read, seq_lens_q, prefix_lens, logit_requests, check)

    @classmethod
    def from_arrays(cls, kv_pool: KVPool, input_ids: np.ndarray, write_slots: np.ndarray, seq_lens_q: list[int],
                    prefix_lens: list[int], read_slots: np.ndarray | None = None,
                    logit_requests: Sequence[int] | None = None, check: bool = True) -> PrefillBatch:
        """A batch from the packed arrays themselves (what a planner builds in one pass over its chunks), with no
        per-request object or tensor in between.

        Args:
            kv_pool: the pool the slots belong to.
            input_ids: int64 ``(num_tokens,)`` the requests' new tokens, back to back.
            write_slots: int64 ``(num_tokens,)`` the pool slot of each new token.
            seq_lens_q: new tokens per request (each at least one).
            prefix_lens: cached tokens per request.
            read_slots: int64, per request its prefix slots then its new slots; may be None when no request has a
                prefix (it is ``write_slots`` then).
            logit_requests, check: as for the constructor (``check=False``: the caller vouches for the shapes and
                the slots, which it was handed by the pool).

        Example:
            >>> pool = KVPool(num_slots=16, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
            >>> batch = PrefillBatch.from_arrays(pool, np.array([1, 2, 3, 4]), np.array([5, 6, 7, 8]), [3, 1], [0, 2],
            ...                                  read_slots=np.array([5, 6, 7, 0, 1, 8]))
            >>> batch.host_positions.tolist(), batch.max_seqlen_k
            ([0, 1, 2, 2], 3)
        """
        batch = cls.__new__(cls)
        batch._fill(kv_pool, input_ids, write_slots, read_slots, seq_lens_q, prefix_lens, logit_requests, check)
        return batch

    def _fill(self, kv_pool: KVPool, input_ids: np.ndarray, write: np.ndarray, read: np.ndarray | None,
              seq_lens_q: list[int], prefix_lens: list[int], logit_requests: Sequence[int] | None,
              check: bool) -> None:
        self.kv_pool, self.seq_lens_q, self.prefix_lens = kv_pool, seq_lens_q, prefix_lens
        # Scalars and prefix sums from the Python lists (a builtin over a few ints costs less than a numpy call: this
        # runs before every forward, while the GPU waits), the per-token arrays in numpy.
        self.num_tokens = total = sum(seq_lens_q)
        self.has_prefix = has_prefix = any(prefix_lens)
        if check:
            _check_arrays(input_ids, write, read, np.array(seq_lens_q, dtype=np.int64),
                          np.array(prefix_lens, dtype=np.int64), has_prefix)
        cu_q = np.array([0, *accumulate(seq_lens_q)], dtype=np.int64)
        self.max_seqlen_q = max(seq_lens_q)
        if has_prefix:
            seq_k = [q + p for q, p in zip(seq_lens_q, prefix_lens)]
            cu_k = np.array([0, *accumulate(seq_k)], dtype=np.int64)
            self.max_seqlen_k = max(seq_k)
        else:
            cu_k, self.max_seqlen_k = cu_q, self.max_seqlen_q
        self.host_cu_seqlens_q, self.host_cu_seqlens_k = cu_q, cu_k
        positions = np.arange(total, dtype=np.int64)
        if has_prefix or len(seq_lens_q) > 1:
            positions += np.repeat(np.array(prefix_lens, dtype=np.int64) - cu_q[:-1], seq_lens_q)
        self.host_positions = positions
        self.host_input_ids, self.host_write_slots = input_ids, write
        self.host_read_slots = read if has_prefix else write
        if check:
            check_slots(self.host_read_slots, kv_pool.num_slots)
        last_rows = cu_q[1:] - 1
        self.host_logit_rows = last_rows if logit_requests is None else last_rows[np.asarray(logit_requests,
                                                                                             dtype=np.int64)]

    @property
    def num_requests(self) -> int:
        """Number of requests in the batch."""
        return len(self.seq_lens_q)

    @functools.cached_property
    def host_run_starts(self) -> np.ndarray:
        """Per request, its first key slot where its key slots (``host_read_slots``) run up by one, else -1
        (:func:`~bcg.ops.kv_cache.run_starts`); made on first use, by the whole-step graphs' attention."""
        return run_starts(self.host_read_slots, self.host_cu_seqlens_k)

    @property
    def num_logit_rows(self) -> int:
        """Rows whose logits the forward computes (one per wanted request)."""
        return len(self.host_logit_rows)

    @functools.cached_property
    def _device(self) -> dict[str, Tensor]:
        # For tools and tests: the batch's own arrays on the device, in one copy (the runner stages its own).
        parts = {"input_ids": self.host_input_ids, "positions": self.host_positions,
                 "write_slots": self.host_write_slots, "read_slots": self.host_read_slots,
                 "logits_indices": self.host_logit_rows}
        packed = torch.from_numpy(np.concatenate(list(parts.values())))
        if self.kv_pool.device.type == "cuda":
            packed = packed.pin_memory().to(self.kv_pool.device, non_blocking=True)
        cu = torch.from_numpy(np.concatenate([self.host_cu_seqlens_q, self.host_cu_seqlens_k]).astype(np.int32))
        cu = cu.to(self.kv_pool.device)
        views = dict(zip(parts, packed.split([len(a) for a in parts.values()])))
        r = self.num_requests
        views["cu_seqlens_q"], views["cu_seqlens_k"] = cu[: r + 1], cu[r + 1 :]
        return views

    # The batch's own arrays on the device (for tools and tests), made on first use.
    input_ids = property(lambda self: self._device["input_ids"], doc="int64 ``(num_tokens,)`` token ids.")
    positions = property(lambda self: self._device["positions"], doc="int64 ``(num_tokens,)`` positions.")
    write_slots = property(lambda self: self._device["write_slots"], doc="int64 pool slot of each new token.")
    read_slots = property(lambda self: self._device["read_slots"], doc="int64 key slots, as ``host_read_slots``.")
    logits_indices = property(lambda self: self._device["logits_indices"], doc="int64 rows of the wanted logits.")
    cu_seqlens_q = property(lambda self: self._device["cu_seqlens_q"], doc="int32 ``(R + 1,)`` new-token sums.")
    cu_seqlens_k = property(lambda self: self._device["cu_seqlens_k"], doc="int32 ``(R + 1,)`` key-range sums.")

    def to_context(self, num_padded_tokens: int, backend: AttentionBackend | None = None) -> ForwardContext:
        """The forward context for running this batch padded to ``num_padded_tokens`` rows, through ``backend``
        (default: the live backend for the pool's device and dtype), its fields in fresh device memory."""
        if not 0 < self.num_tokens <= num_padded_tokens:
            raise ValueError(f"need 0 < num_tokens <= num_padded_tokens, got num_tokens={self.num_tokens}, "
                             f"num_padded_tokens={num_padded_tokens}")
        if backend is None:
            pool = self.kv_pool
            dtype = next((t.dtype for t in pool.k if t is not None), torch.float32)
            backend = attention_backend(default_attention_backend(pool.device, dtype))(pool)
        staged = Staged(Layout(*backend.fields(num_padded_tokens)), backend.tail_lengths(self), self.kv_pool.device)
        backend.stage(self, num_padded_tokens, staged)
        return backend.context(self, num_padded_tokens, staged.upload())


def _check_arrays(input_ids: np.ndarray, write: np.ndarray, read: np.ndarray | None, seq_q: np.ndarray,
                  prefix: np.ndarray, has_prefix: bool) -> None:
    """ValueError unless the packed arrays agree with the per-request lengths."""
    if seq_q.size == 0:
        raise ValueError("a prefill batch needs at least one request")
    if int(seq_q.min()) <= 0:
        raise ValueError("a prefill item needs at least one new token")
    if int(prefix.min()) < 0 or prefix.size != seq_q.size:
        raise ValueError(f"prefix_lens {prefix.tolist()} must be one non-negative length per request")
    total = int(seq_q.sum())
    if input_ids.shape != (total,) or write.shape != (total,):
        raise ValueError(f"{total} new tokens by seq_lens_q but {input_ids.shape} token ids and {write.shape} new "
                         "slots; pass 1-D arrays of one entry per new token")
    if has_prefix and (read is None or read.shape != (total + int(prefix.sum()),)):
        raise ValueError(f"read_slots must hold each request's prefix then its new slots ({total + int(prefix.sum())} "
                         f"in all), got {None if read is None else read.shape}")


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
