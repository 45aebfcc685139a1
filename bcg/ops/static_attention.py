"""Capturable attention over static metadata: the forward context of a whole-layer-stack graph (backend="full").

The live :class:`~bcg.ops.attention.BatchContext` carries host ints (token and request counts) and tensors made
per batch; a graph that contains the attention would bake both in. A :class:`StaticContext` instead holds views of
device buffers sized for the bucket's upper bounds: ``R`` request slots (live requests fill the first ones, the
rest are zero-length sentinels), the bucket's rows (padded rows write the KV pool's scratch slot) and a static key
capacity (unused key slots read the scratch slot and are masked). The backend that captures with it owns those
buffers and rewrites every field on each load (:mod:`bcg.runtime.backends.static_metadata`).

Every shape is fixed by the bucket: all rows write their K/V, the key capacity is gathered from the pool by the
static read slots, and no value is read back to the host. Two implementations compute the same thing:

* CUDA, bf16/fp16: FlashAttention varlen with the static ``cu_seqlens`` buffers; ``max_seqlen_q`` is the bucket
  and ``max_seqlen_k`` the key capacity (upper bounds, so the graph is valid for every batch that fits). Sentinel
  request slots are zero-length sequences; rows past the last sequence are left unwritten by the kernel and
  zeroed here.
* Everything else (CPU, fp32): one SDPA call over all rows and the whole key capacity, with a mask built on the
  device from static per-row/per-key request ids and positions (same request, key position <= row position).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bcg.capture_rules import UncapturableOpError
from bcg.ops.context import ForwardContext
from bcg.ops.flash import flash_varlen, is_varlen_usable, varlen_causal_is_bottom_right
from bcg.ops.kv_cache import KVPool
from bcg.ops.sdpa import gqa_sdpa

__all__ = ["PAD_KEY", "PAD_QUERY", "StaticContext", "static_attention", "static_varlen_usable"]

# Request ids of rows and keys that belong to no request; different, so a padded row never matches an unused key.
PAD_QUERY, PAD_KEY = -1, -2


class StaticContext(ForwardContext):
    """The metadata of one bucket as fixed-address device tensors (a :class:`~bcg.ops.context.ForwardContext`).

    Attributes:
        num_padded_tokens: rows of the bucket (``max_seqlen_q`` of the captured attention).
        key_capacity: key slots gathered per layer (``max_seqlen_k``): the bucket plus the prefix capacity.
        num_request_slots: ``R``; ``cu_seqlens_q/k`` have ``R + 1`` entries.
        use_varlen: the captured attention calls FlashAttention varlen (else masked SDPA over the key capacity).
        write_slots: int64 ``(num_padded_tokens,)``, KV slot of each row; padded rows hold the scratch slot.
        read_slots: int64 ``(key_capacity,)``, each live request's prefix then new slots, then scratch.
        query_request, key_request: int64 request id per row / key slot (``PAD_QUERY`` / ``PAD_KEY`` when unused).
        query_positions, key_positions: int64 position of each row (the runner's static positions) / key.
        cu_seqlens_q, cu_seqlens_k: int32 ``(R + 1,)`` prefix sums; sentinel slots repeat the total.
        kv_pool: the pool the captured attention reads and writes.

    Example::

        meta = StaticMetadata(pool, [16], max_requests=4, prefix_capacity=32, positions=static_positions,
                              use_varlen=False)
        ctx = meta.load(batch, 16)          # copies the batch in; same tensors every time
        with forward_context(ctx):
            graph.replay()                  # the captured attention reads ctx's buffers
    """

    def __init__(self, num_padded_tokens: int, key_capacity: int, num_request_slots: int, use_varlen: bool,
                 fields: dict[str, Tensor], query_positions: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                 kv_pool: KVPool) -> None:
        self.num_padded_tokens = num_padded_tokens
        self.key_capacity, self.num_request_slots, self.use_varlen = key_capacity, num_request_slots, use_varlen
        self.write_slots, self.read_slots = fields["write_slots"], fields["read_slots"]
        self.query_request, self.key_request = fields["query_request"], fields["key_request"]
        self.key_positions, self.query_positions = fields["key_positions"], query_positions
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.kv_pool = kv_pool

    def __repr__(self) -> str:
        return (f"StaticContext(num_padded_tokens={self.num_padded_tokens}, key_capacity={self.key_capacity}, "
                f"num_request_slots={self.num_request_slots}, use_varlen={self.use_varlen})")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        """:func:`static_attention` over this context (fixed shapes; also inside a graph capture)."""
        static_attention(q, k, v, out, layer_id, self)

    def live(self, island: str, why: str) -> ForwardContext:
        """Raises: an island that needs the live batch cannot be captured in a whole-layer-stack graph."""
        raise UncapturableOpError(f"{island} cannot be captured in a whole-layer-stack graph (backend='full'): "
                                  f"{why}.")


def static_varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the captured attention can use ``varlen_attn`` here; call before capture (it may probe the kernel).

    A batch with a cached prefix needs the causal diagonal bottom-right aligned; whether a prefix occurs is not
    known at capture, so a top-left kernel means the masked path for every batch.
    """
    probe = torch.empty(0, device=device, dtype=dtype)
    return is_varlen_usable(probe) and varlen_causal_is_bottom_right(device)


def static_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, ctx: StaticContext) -> None:
    """Causal attention of the bucket's rows, written into ``out`` (padded rows zeroed); same contract as
    :meth:`bcg.ops.attention.BatchContext.attend`, fixed shapes only.

    Example::

        with forward_context(static_metadata.load(batch, 16)):
            static_attention(q, k, v, out, 0, get_forward_context())   # also inside a graph capture
    """
    pool = ctx.kv_pool
    k_cache, v_cache = pool.k[layer_id], pool.v[layer_id]
    # Every row writes: padded rows land in the scratch slot, which no request reads.
    k_cache.index_copy_(0, ctx.write_slots, k)
    v_cache.index_copy_(0, ctx.write_slots, v)
    keys = k_cache.index_select(0, ctx.read_slots)
    values = v_cache.index_select(0, ctx.read_slots)
    if ctx.use_varlen:
        result = flash_varlen(q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.num_padded_tokens,
                              ctx.key_capacity, is_causal=True)
    else:
        result = masked_attention(q, keys, values, ctx)
    # where, not a multiply: rows the kernel left unwritten (or fully masked) may hold NaN.
    out.copy_(torch.where((ctx.query_request >= 0)[:, None, None], result, 0.0))


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: StaticContext) -> Tensor:
    """All rows against the whole key capacity, masked to same-request causal pairs; ``(rows, heads, dim)``."""
    visible = (ctx.query_request[:, None] == ctx.key_request[None, :]) & (
        ctx.key_positions[None, :] <= ctx.query_positions[:, None])
    # Unused key slots hold whatever the scratch slot holds; a masked key still multiplies its value by 0.
    values = torch.where((ctx.key_request >= 0)[:, None, None], values, 0.0)
    q_, k_, v_ = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    return gqa_sdpa(q_, k_, v_, attn_mask=visible[None, None])[0].transpose(0, 1)
