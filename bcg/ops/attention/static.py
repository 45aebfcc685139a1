"""Capturable attention over fixed-size metadata: the attention of a whole-layer-stack graph (backend="full").

The live batch carries host ints (token and request counts) that a graph containing the attention would bake in. A
:class:`StaticContext` instead reads fields sized for the bucket's upper bounds: ``R`` request slots (live requests
fill the first ones, the rest are zero-length sentinels), the bucket's rows (padded rows write the KV pool's scratch
slot) and a key capacity (unused key slots read the scratch slot and are masked). :class:`StaticAttention` owns
those fields (its capture metadata) and rewrites every one of them for each batch, so nothing of an earlier batch
survives.

Every shape is fixed by the bucket: all rows write their K/V, the key capacity is gathered from the pool by the
static read slots, and no value is read back to the host. Two implementations compute the same thing:

* CUDA, bf16/fp16: FlashAttention varlen with the static ``cu_seqlens``; ``max_seqlen_q`` is the bucket and
  ``max_seqlen_k`` the key capacity (upper bounds, so the graph is valid for every batch that fits). Sentinel
  request slots are zero-length sequences; rows past the last sequence are left unwritten by the kernel and zeroed.
* ``attention_backend="static_triton"`` (:class:`~bcg.ops.attention.static_triton.StaticTritonAttention`, CUDA
  with Triton, or the kernel's reference on a CPU; fp16/bf16): bcg's Triton varlen kernel reads every key straight
  from the pool through ``read_slots`` (no gather per layer) on the same grid (``max_seqlen_q`` the bucket, the key
  capacity as ``max_seqlen_k``), and zeroes the rows past the last sequence in the same launch (no fill).
* Everything else (CPU, fp32): one SDPA call over all rows and the whole key capacity, with a mask built on the
  device from the per-row/per-key request ids and positions (same request, key position <= row position). Unused
  keys and values are zeroed first: the scratch slot may hold anything (a NaN there must not reach a real row).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from bcg.capture_rules import UncapturableOpError
from bcg.ops.attention.base import AttentionBackend, HostBatch, register_attention_backend
from bcg.ops.attention.gqa import gqa_sdpa
from bcg.ops.context import ForwardContext
from bcg.ops.flash import flash_varlen, is_varlen_usable, varlen_causal_is_bottom_right
from bcg.ops.kernels.attention import varlen_attention
from bcg.ops.kv_cache import KVPool
from bcg.ops.staging import Field, Staged

__all__ = ["PAD_KEY", "PAD_QUERY", "StaticAttention", "StaticContext"]

# Request ids of rows and keys that belong to no request; different, so a padded row never matches an unused key.
PAD_QUERY, PAD_KEY = -1, -2


class StaticContext(ForwardContext):
    """The metadata of one bucket as fixed-address device tensors (a :class:`~bcg.ops.context.ForwardContext`).

    Attributes:
        num_padded_tokens: rows of the bucket (``max_seqlen_q`` of the captured attention).
        key_capacity: key slots gathered per layer (``max_seqlen_k``): the bucket plus the prefix capacity.
        num_request_slots: ``R``; ``cu_seqlens_q/k`` have ``R + 1`` entries.
        use_varlen: the captured attention calls FlashAttention varlen (else masked SDPA over the key capacity).
        use_slot_kernel: the captured attention is bcg's varlen kernel reading the pool through ``read_slots``
            (it then takes precedence over ``use_varlen``).
        write_slots: int64 ``(num_padded_tokens,)``, KV slot of each row; padded rows hold the scratch slot.
        read_slots: int64 ``(key_capacity,)``, each live request's prefix then new slots, then scratch.
        kv_base: the slot kernel's int64 ``(R,)`` first slot of each request whose slots run up by one, else -1
            (None under ``kv_reads="slots"``); kv_slots: what that kernel reads keys through (``read_slots``, or
            None under ``"runs_only"``: every request by address).
        query_request, key_request: int64 request id per row / key slot (``PAD_QUERY`` / ``PAD_KEY`` when unused);
            None for the slot kernel, which masks by ``cu_seqlens`` alone.
        query_positions, key_positions: int64 position of each row / key (None for the slot kernel).
        cu_seqlens: int32 ``(2 * (R + 1),)``, the field both are views of.
        cu_seqlens_q, cu_seqlens_k: int32 ``(R + 1,)`` prefix sums; sentinel slots repeat the total.
        kv_pool: the pool the captured attention reads and writes.
    """

    attends_in_graph = True

    def __init__(self, num_padded_tokens: int, key_capacity: int, num_request_slots: int, use_varlen: bool,
                 views: dict[str, Tensor], kv_pool: KVPool, use_slot_kernel: bool = False,
                 runs_only: bool = False) -> None:
        self.num_padded_tokens, self.key_capacity = num_padded_tokens, key_capacity
        self.num_request_slots, self.use_varlen = num_request_slots, use_varlen
        self.use_slot_kernel = use_slot_kernel
        self.write_slots, self.read_slots = views["write_slots"], views["read_slots"]
        # The masks' fields (absent for the slot kernel, which masks by cu_seqlens alone).
        self.query_request, self.key_request = views.get("query_request"), views.get("key_request")
        self.query_positions, self.key_positions = views.get("query_positions"), views.get("key_positions")
        self.kv_base = views.get("kv_base")  # the slot kernel's runs of slots (BCG_KV_READS), else None
        self.kv_slots = None if runs_only else self.read_slots  # runs_only: every key by address from kv_base
        self.cu_seqlens = cu = views["cu_seqlens"]
        self.cu_seqlens_q, self.cu_seqlens_k = cu[: num_request_slots + 1], cu[num_request_slots + 1 :]
        self.kv_pool = kv_pool

    def __repr__(self) -> str:
        return (f"StaticContext(num_padded_tokens={self.num_padded_tokens}, key_capacity={self.key_capacity}, "
                f"num_request_slots={self.num_request_slots}, use_varlen={self.use_varlen}, "
                f"use_slot_kernel={self.use_slot_kernel})")

    def store_kv(self, layer_id: int, k: Tensor, v: Tensor) -> None:
        # Every row writes: padded rows land in the scratch slot, which no request reads.
        self.kv_pool.k[layer_id].index_copy_(0, self.write_slots, k)
        self.kv_pool.v[layer_id].index_copy_(0, self.write_slots, v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        """Causal attention of the bucket's rows into ``out`` (padded rows zeroed); fixed shapes only."""
        pool = self.kv_pool
        if self.use_slot_kernel:
            # One launch: keys and values read in place through the slots, padded rows (past the last sequence,
            # sentinel slots being empty) written 0 by the kernel itself.
            varlen_attention(q, pool.k[layer_id], pool.v[layer_id], self.cu_seqlens_q, self.cu_seqlens_k,
                             self.num_padded_tokens, self.key_capacity, out, kv_slots=self.kv_slots,
                             zero_tail=True, kv_base=self.kv_base)
            return
        keys = pool.k[layer_id].index_select(0, self.read_slots)
        values = pool.v[layer_id].index_select(0, self.read_slots)
        if self.use_varlen:
            result = flash_varlen(q, keys, values, self.cu_seqlens_q, self.cu_seqlens_k, self.num_padded_tokens,
                                  self.key_capacity, is_causal=True)
        else:
            result = masked_attention(q, keys, values, self)
        # where, not a multiply: rows the kernel left unwritten (or fully masked) may hold NaN.
        out.copy_(torch.where((self.query_request >= 0)[:, None, None], result, 0.0))

    def live(self, island: str, why: str) -> ForwardContext:
        """Raises: an island that needs the live batch cannot be captured in a whole-layer-stack graph."""
        raise UncapturableOpError(f"{island} cannot be captured in a whole-layer-stack graph (backend='full'): "
                                  f"{why}.")


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: StaticContext) -> Tensor:
    """All rows against the whole key capacity, masked to same-request causal pairs; ``(rows, heads, dim)``."""
    visible = (ctx.query_request[:, None] == ctx.key_request[None, :]) & (
        ctx.key_positions[None, :] <= ctx.query_positions[:, None])
    # Unused key slots hold whatever the scratch slot holds: a NaN key would make its masked score NaN (NaN plus
    # the mask's -inf), and a NaN value times a zero weight is NaN, so both are zeroed.
    is_key = (ctx.key_request >= 0)[:, None, None]
    keys, values = torch.where(is_key, keys, 0.0), torch.where(is_key, values, 0.0)
    q_, k_, v_ = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    return gqa_sdpa(q_, k_, v_, attn_mask=visible[None, None])[0].transpose(0, 1)


@register_attention_backend
class StaticAttention(AttentionBackend):
    """Attention captured inside the graph, over request slots and a key capacity (``attention_backend="static"``,
    the "full" backend's).

    Args:
        kv_pool: the pool.
        max_requests: ``R``, the most requests one batch may pack.
        prefix_capacity: cached-prefix keys (summed over requests) a bucket attends to on top of its own rows.
        use_varlen: FlashAttention varlen inside the graph (else masked SDPA); None decides from the pool's device
            and dtype (probing the kernel's causal alignment: call before any capture).

    Example::

        attn = StaticAttention(pool, max_requests=4, prefix_capacity=32)
        attn.check(batch, 16)       # None, or why the batch does not fit (it then runs eagerly)
    """

    name = "static"
    is_island = False
    use_slot_kernel: ClassVar[bool] = False  # bcg's varlen kernel over the pool's slots (``static_triton``)

    def __init__(self, kv_pool: KVPool, max_requests: int = 4, prefix_capacity: int = 0,
                 use_varlen: bool | None = None) -> None:
        super().__init__(kv_pool)
        self.max_requests, self.prefix_capacity = max_requests, prefix_capacity
        if use_varlen is None:
            probe = kv_pool.k[0] if kv_pool.k and kv_pool.k[0] is not None else torch.empty(0)
            use_varlen = is_varlen_usable(probe) and varlen_causal_is_bottom_right(probe.device)
        self.use_varlen = use_varlen
        self._contexts: dict[int, StaticContext] = {}  # by bucket (see context)

    @property
    def max_batch_requests(self) -> int:
        return self.max_requests

    def reads(self, bucket: int) -> str:
        """How bucket ``bucket``'s slot kernel reads keys: "slots", "runs" or "runs_only" (``static_triton``)."""
        return "slots"

    def key_capacity(self, bucket: int) -> int:
        # Keys of one batch are distinct pool slots, so no batch has more than num_slots of them.
        return min(bucket + self.prefix_capacity, self.kv_pool.num_slots)

    def fields(self, num_rows: int) -> tuple[list[Field], tuple[Field, ...]]:
        keys = self.key_capacity(num_rows)
        slots = [Field("write_slots", num_rows), Field("read_slots", keys),
                 Field("cu_seqlens", 2 * (self.max_requests + 1), "int32")]
        if self.use_slot_kernel:  # it reads keys through read_slots and masks by cu_seqlens: nothing else to stage
            return slots + ([Field("kv_base", self.max_requests)] if self.reads(num_rows) != "slots" else []), ()
        return slots + [Field("query_request", num_rows), Field("query_positions", num_rows),
                        Field("key_request", keys), Field("key_positions", keys)], ()

    def tail_lengths(self, batch: HostBatch) -> dict[str, int]:
        return {}

    def check(self, batch: HostBatch, bucket: int) -> str | None:
        """Why ``batch`` does not fit ``bucket``'s static bounds (a reason for telemetry), or None."""
        if batch.num_requests > self.max_requests:
            return "too_many_requests"
        if batch.num_tokens + sum(batch.prefix_lens) > self.key_capacity(bucket):
            return "too_many_keys"
        if self.reads(bucket) == "runs_only" and min(batch.host_run_starts) < 0:
            return "slots_not_in_runs"
        return None

    def stage(self, batch: HostBatch, num_rows: int, staged: Staged) -> None:
        reason = self.check(batch, num_rows)
        if reason is not None:
            raise ValueError(f"a batch of {batch.num_requests} requests and {batch.num_tokens} tokens does not fit "
                             f"bucket {num_rows} ({reason}); check StaticAttention.check first")
        h, n, r, slots = staged.host, batch.num_tokens, batch.num_requests, self.max_requests
        cu_k = batch.host_cu_seqlens_k
        num_keys = int(cu_k[-1])
        h["write_slots"][:n] = batch.host_write_slots
        h["write_slots"][n:] = self.kv_pool.scratch_slot  # padded rows write the scratch slot
        h["read_slots"][:num_keys] = batch.host_read_slots
        h["read_slots"][num_keys:] = self.kv_pool.scratch_slot  # never attended to, but a valid slot
        cu = h["cu_seqlens"]  # sentinel slots: zero-length sequences after the live ones
        cu[: r + 1] = batch.host_cu_seqlens_q
        cu[r + 1 : slots + 1] = n
        cu[slots + 1 : slots + r + 2] = cu_k
        cu[slots + r + 2 :] = num_keys
        if self.use_slot_kernel:  # it masks by cu_seqlens alone
            if self.reads(num_rows) != "slots":
                h["kv_base"][:r] = batch.host_run_starts
                h["kv_base"][r:] = -1  # sentinel request slots: empty, never read
            return
        seq_q = np.asarray(batch.seq_lens_q, dtype=np.int64)
        seq_k = np.diff(cu_k)
        h["query_request"][:n] = np.repeat(np.arange(r), seq_q)
        h["query_request"][n:] = PAD_QUERY
        h["query_positions"][:n] = np.arange(n) - np.repeat(batch.host_cu_seqlens_q[:-1] - (seq_k - seq_q), seq_q)
        h["query_positions"][n:] = 0
        h["key_request"][:num_keys] = np.repeat(np.arange(r), seq_k)
        h["key_request"][num_keys:] = PAD_KEY
        h["key_positions"][:num_keys] = np.arange(num_keys) - np.repeat(cu_k[:-1], seq_k)
        h["key_positions"][num_keys:] = 0

    def context(self, batch: HostBatch, num_rows: int, views: dict[str, Tensor]) -> StaticContext:
        # A bucket's context holds nothing of the batch, only the arena's views: made once per bucket (its tensor
        # slices cost microseconds while the GPU waits), and again for fields staged anywhere else.
        ctx = self._contexts.get(num_rows)
        if ctx is None or ctx.cu_seqlens is not views["cu_seqlens"] or ctx.write_slots is not views["write_slots"]:
            ctx = self._contexts[num_rows] = StaticContext(num_rows, self.key_capacity(num_rows), self.max_requests,
                                                           self.use_varlen, views, self.kv_pool, self.use_slot_kernel,
                                                           self.reads(num_rows) == "runs_only")
        return ctx

    def attend(self, ctx: StaticContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor,  # type: ignore[override]
               layer_id: int) -> None:
        ctx.attend(q, k, v, out, layer_id)  # the context attends itself, over its fixed-size fields

