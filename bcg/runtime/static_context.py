"""Batch metadata at fixed addresses, so attention can be captured inside a whole-layer-stack graph.

The live :class:`~bcg.runtime.context.ForwardContext` carries host ints (token and request counts) and tensors
made per batch; a graph that contains the attention would bake both in. A :class:`StaticForwardContext` instead
holds views of device buffers sized for the bucket's upper bounds: ``R`` request slots (live requests fill the
first ones, the rest are zero-length sentinels), the bucket's rows (padded rows write the KV pool's scratch slot)
and a static key capacity (unused key slots read the scratch slot and are masked). :class:`StaticMetadata` owns
those buffers and rewrites every field of a bucket on each load, so nothing of an earlier batch survives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bcg.emulation import UncapturableOpError
from bcg.runtime.kv_cache import KVPool

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch

__all__ = ["StaticForwardContext", "StaticMetadata", "refuse_static"]

# Request ids of rows and keys that belong to no request; different, so a padded row never matches an unused key.
PAD_QUERY, PAD_KEY = -1, -2


class StaticForwardContext:
    """The metadata of one bucket as fixed-address device tensors (see the module docstring).

    Attributes:
        num_padded_tokens: rows of the bucket (``max_seqlen_q`` of the captured attention).
        key_capacity: key slots gathered per layer (``max_seqlen_k``): the bucket plus the prefix capacity.
        num_request_slots: ``R``; ``cu_seqlens_q/k`` have ``R + 1`` entries.
        use_varlen: the captured attention calls ``varlen_attn`` (else masked SDPA over the key capacity).
        write_slots: int64 ``(num_padded_tokens,)``, KV slot of each row; padded rows hold the scratch slot.
        read_slots: int64 ``(key_capacity,)``, each live request's prefix then new slots, then scratch.
        query_request, key_request: int64 request id per row / key slot (``-1`` / ``-2`` when unused).
        query_positions, key_positions: int64 position of each row (the runner's static positions) / key.
        cu_seqlens_q, cu_seqlens_k: int32 ``(R + 1,)`` prefix sums; sentinel slots repeat the total.
        kv_pool: the pool the captured attention reads and writes.

    Example::

        meta = StaticMetadata(pool, [16], request_slots=4, prefix_keys=32, positions=static_positions,
                              use_varlen=False)
        ctx = meta.load(batch, 16)          # copies the batch in; same tensors every time
        with forward_context(ctx):
            graph.replay()                  # the captured attention reads ctx's buffers
    """

    def __init__(self, num_padded_tokens: int, key_capacity: int, num_request_slots: int, use_varlen: bool,
                 fields: dict[str, Tensor], query_positions: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                 kv_pool: KVPool) -> None:
        self.num_padded_tokens, self.key_capacity = num_padded_tokens, key_capacity
        self.num_request_slots, self.use_varlen = num_request_slots, use_varlen
        self.write_slots, self.read_slots = fields["write_slots"], fields["read_slots"]
        self.query_request, self.key_request = fields["query_request"], fields["key_request"]
        self.key_positions, self.query_positions = fields["key_positions"], query_positions
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.kv_pool = kv_pool

    def __repr__(self) -> str:
        return (f"StaticForwardContext(num_padded_tokens={self.num_padded_tokens}, key_capacity={self.key_capacity}, "
                f"num_request_slots={self.num_request_slots}, use_varlen={self.use_varlen})")


# Field order of a bucket's slice of the metadata buffer; sizes in units of (rows, keys, request slots + 1).
_LAYOUT = (("write_slots", 1, 0, 0), ("read_slots", 0, 1, 0), ("query_request", 1, 0, 0),
           ("key_request", 0, 1, 0), ("key_positions", 0, 1, 0), ("cu_seqlens_q", 0, 0, 1), ("cu_seqlens_k", 0, 0, 1))


class StaticMetadata:
    """Owns the device buffers behind every bucket's :class:`StaticForwardContext` and loads batches into them.

    Buckets are never replayed at the same time, so they share one int64 buffer, each with its own packed layout;
    loading a batch is then one host-to-device copy of the whole bucket slice (sentinels included), two
    device copies of the batch's slot lists and one cast of the prefix sums to int32.

    Args:
        kv_pool: the KV pool (its scratch slot absorbs padded rows).
        buckets: the token buckets.
        request_slots: ``R``, the most requests one batch may pack.
        prefix_keys: cached-prefix keys (summed over requests) a bucket can attend to on top of its own rows.
        positions: the runner's static positions buffer (row positions are read from it).
        use_varlen: whether the captured attention uses ``varlen_attn``.
    """

    def __init__(self, kv_pool: KVPool, buckets: list[int], request_slots: int, prefix_keys: int,
                 positions: Tensor, use_varlen: bool) -> None:
        self.kv_pool, self.request_slots, self.use_varlen = kv_pool, request_slots, use_varlen
        device = kv_pool.device
        # Keys of one batch are distinct pool slots, so no batch has more than num_slots of them.
        self.key_capacity = {b: min(b + prefix_keys, kv_pool.num_slots) for b in buckets}
        self._sizes = {b: self._field_sizes(b) for b in buckets}
        self._buffer = torch.zeros(max(sum(s) for s in self._sizes.values()), dtype=torch.int64, device=device)
        cu32 = torch.zeros(2 * (request_slots + 1), dtype=torch.int32, device=device)
        self._cu32 = cu32
        self._contexts: dict[int, StaticForwardContext] = {}
        for b in buckets:
            fields = dict(zip((name for name, *_ in _LAYOUT), self._buffer[: sum(self._sizes[b])].split(self._sizes[b])))
            self._contexts[b] = StaticForwardContext(
                b, self.key_capacity[b], request_slots, use_varlen, fields, positions[:b],
                cu32[: request_slots + 1], cu32[request_slots + 1 :], kv_pool)

    def _field_sizes(self, bucket: int) -> list[int]:
        unit = (bucket, self.key_capacity[bucket], self.request_slots + 1)
        return [sum(n * u for n, u in zip(units, unit)) for _, *units in _LAYOUT]

    def context(self, bucket: int) -> StaticForwardContext:
        """The (unloaded) context of ``bucket``."""
        return self._contexts[bucket]

    def check(self, batch: PrefillBatch, bucket: int) -> str | None:
        """Why ``batch`` does not fit ``bucket``'s static bounds (a reason for telemetry), or None."""
        if batch.num_requests > self.request_slots:
            return "too_many_requests"
        if batch.num_tokens + sum(batch.prefix_lens) > self.key_capacity[bucket]:
            return "too_many_keys"
        return None

    def load(self, batch: PrefillBatch, bucket: int) -> StaticForwardContext:
        """Writes every field of ``bucket`` for ``batch`` (sentinels included) and returns its context.

        Raises:
            ValueError: the batch does not fit (callers check :meth:`check` first).
        """
        reason = self.check(batch, bucket)
        if reason is not None:
            raise ValueError(f"a batch of {batch.num_requests} requests and {batch.num_tokens} tokens does not fit "
                             f"bucket {bucket} ({reason}); check StaticMetadata.check first")
        ctx, sizes = self._contexts[bucket], self._sizes[bucket]
        n, num_requests, slots = batch.num_tokens, batch.num_requests, self.request_slots
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


def refuse_static(ctx: object, island: str, why: str) -> None:
    """Raises :class:`UncapturableOpError` when ``island`` meets a :class:`StaticForwardContext`.

    For islands that read the live batch on the host or have data-dependent shapes: inside a whole-graph capture
    they cannot work, and saying so by name beats an AttributeError (the runner then refuses the backend).
    """
    if isinstance(ctx, StaticForwardContext):
        raise UncapturableOpError(f"{island} cannot be captured in a whole-layer-stack graph (backend='full'): "
                                  f"{why}.")
