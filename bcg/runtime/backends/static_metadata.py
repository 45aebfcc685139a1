"""The full backend's capture metadata: the device buffers behind every bucket's static attention context.

A whole-layer-stack graph bakes in the addresses of everything its attention reads, so the batch metadata lives in
fixed device buffers (:class:`~bcg.ops.static_attention.StaticContext` views them); :class:`StaticMetadata` owns
those buffers and rewrites every field of a bucket on each load, so nothing of an earlier batch survives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bcg.ops.kv_cache import KVPool
from bcg.ops.static_attention import PAD_KEY, PAD_QUERY, StaticContext

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch

__all__ = ["StaticMetadata"]


# Field order of a bucket's slice of the metadata buffer; sizes in units of (rows, keys, request slots + 1).
_LAYOUT = (("write_slots", 1, 0, 0), ("read_slots", 0, 1, 0), ("query_request", 1, 0, 0),
           ("key_request", 0, 1, 0), ("key_positions", 0, 1, 0), ("cu_seqlens_q", 0, 0, 1), ("cu_seqlens_k", 0, 0, 1))


class StaticMetadata:
    """Owns the device buffers behind every bucket's :class:`StaticContext` and loads batches into them.

    Buckets are never replayed at the same time, so they share one int64 buffer, each with its own packed layout;
    loading a batch is then one host-to-device copy of the whole bucket slice (sentinels included), two
    device copies of the batch's slot lists and one cast of the prefix sums to int32.

    Args:
        kv_pool: the KV pool (its scratch slot absorbs padded rows).
        buckets: the token buckets.
        max_requests: ``R``, the request slots: the most requests one batch may pack.
        prefix_capacity: cached-prefix keys (summed over requests) a bucket can attend to on top of its own rows.
        positions: the runner's static positions buffer (row positions are read from it).
        use_varlen: whether the captured attention uses FlashAttention varlen.
    """

    def __init__(self, kv_pool: KVPool, buckets: list[int], max_requests: int, prefix_capacity: int,
                 positions: Tensor, use_varlen: bool) -> None:
        self.kv_pool, self.max_requests, self.use_varlen = kv_pool, max_requests, use_varlen
        device = kv_pool.device
        # Keys of one batch are distinct pool slots, so no batch has more than num_slots of them.
        self.key_capacity = {b: min(b + prefix_capacity, kv_pool.num_slots) for b in buckets}
        self._sizes = {b: self._field_sizes(b) for b in buckets}
        self._buffer = torch.zeros(max(sum(s) for s in self._sizes.values()), dtype=torch.int64, device=device)
        cu32 = torch.zeros(2 * (max_requests + 1), dtype=torch.int32, device=device)
        self._cu32 = cu32
        self._contexts: dict[int, StaticContext] = {}
        for b in buckets:
            views = self._buffer[: sum(self._sizes[b])].split(self._sizes[b])
            fields = dict(zip((name for name, *_ in _LAYOUT), views))
            self._contexts[b] = StaticContext(
                b, self.key_capacity[b], max_requests, use_varlen, fields, positions[:b],
                cu32[: max_requests + 1], cu32[max_requests + 1 :], kv_pool)

    def _field_sizes(self, bucket: int) -> list[int]:
        unit = (bucket, self.key_capacity[bucket], self.max_requests + 1)
        return [sum(n * u for n, u in zip(units, unit)) for _, *units in _LAYOUT]

    def context(self, bucket: int) -> StaticContext:
        """The (unloaded) context of ``bucket``."""
        return self._contexts[bucket]

    def check(self, batch: PrefillBatch, bucket: int) -> str | None:
        """Why ``batch`` does not fit ``bucket``'s static bounds (a reason for telemetry), or None."""
        if batch.num_requests > self.max_requests:
            return "too_many_requests"
        if batch.num_tokens + sum(batch.prefix_lens) > self.key_capacity[bucket]:
            return "too_many_keys"
        return None

    def load(self, batch: PrefillBatch, bucket: int) -> StaticContext:
        """Writes every field of ``bucket`` for ``batch`` (sentinels included) and returns its context.

        Raises:
            ValueError: the batch does not fit (callers check :meth:`check` first).
        """
        reason = self.check(batch, bucket)
        if reason is not None:
            raise ValueError(f"a batch of {batch.num_requests} requests and {batch.num_tokens} tokens does not fit "
                             f"bucket {bucket} ({reason}); check StaticMetadata.check first")
        ctx, sizes = self._contexts[bucket], self._sizes[bucket]
        n, num_requests, slots = batch.num_tokens, batch.num_requests, self.max_requests
        seq_q = torch.tensor(batch.seq_lens_q)
        seq_k = seq_q + torch.tensor(batch.prefix_lens)
        num_keys = int(seq_k.sum())
        host = torch.empty(sum(sizes), dtype=torch.int64)
        write, read, q_req, k_req, k_pos, cu_q, cu_k = host.split(sizes)
        write.fill_(self.kv_pool.scratch_slot)  # padded rows write the scratch slot; live rows come below
        read.fill_(self.kv_pool.scratch_slot)
        request_ids = torch.arange(num_requests)
        q_req.fill_(PAD_QUERY)
        q_req[:n] = request_ids.repeat_interleave(seq_q)
        k_req.fill_(PAD_KEY)
        k_req[:num_keys] = request_ids.repeat_interleave(seq_k)
        cu_q.fill_(n)  # sentinel slots: zero-length sequences after the live ones
        cu_q[0] = 0
        cu_q[1 : num_requests + 1] = seq_q.cumsum(0)
        cu_k.fill_(num_keys)
        cu_k[0] = 0
        cu_k[1 : num_requests + 1] = seq_k.cumsum(0)
        k_pos.zero_()
        k_pos[:num_keys] = torch.arange(num_keys) - cu_k[:num_requests].repeat_interleave(seq_k)
        buffer = self._buffer[: host.numel()]
        buffer.copy_(host)
        ctx.write_slots[:n].copy_(batch.write_slots)
        ctx.read_slots[:num_keys].copy_(batch.read_slots)
        self._cu32.copy_(buffer[-2 * (slots + 1) :])
        return ctx
