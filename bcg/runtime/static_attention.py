"""Capturable attention over a :class:`~bcg.runtime.static_context.StaticForwardContext` (backend="full").

Every shape is fixed by the bucket: all rows write their K/V (padded rows into the pool's scratch slot), the
key capacity is gathered from the pool by the static read slots, and no value is read back to the host. Two
implementations compute the same thing:

* CUDA, bf16/fp16: ``varlen_attn`` with the static ``cu_seqlens`` buffers; ``max_seqlen_q`` is the bucket and
  ``max_seqlen_k`` the key capacity (upper bounds, so the graph is valid for every batch that fits). Sentinel
  request slots are zero-length sequences; rows past the last sequence are left unwritten by the kernel and
  zeroed here.
* Everything else (CPU, fp32): one SDPA call over all rows and the whole key capacity, with a mask built on the
  device from static per-row/per-key request ids and positions (same request, key position <= row position).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.runtime.attention import _SDPA_HAS_GQA
from bcg.runtime.flash import flash_varlen, is_varlen_usable, varlen_causal_is_bottom_right
from bcg.runtime.static_context import StaticForwardContext

__all__ = ["static_attention", "static_varlen_usable"]


def static_varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the captured attention can use ``varlen_attn`` here; call before capture (it may probe the kernel).

    A batch with a cached prefix needs the causal diagonal bottom-right aligned; whether a prefix occurs is not
    known at capture, so a top-left kernel means the masked path for every batch.
    """
    probe = torch.empty(0, device=device, dtype=dtype)
    return is_varlen_usable(probe) and varlen_causal_is_bottom_right(device)


def static_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, ctx: StaticForwardContext) -> None:
    """Causal attention of the bucket's rows, written into ``out`` (padded rows zeroed); same contract as
    :func:`bcg.runtime.attention.attention`, fixed shapes only.

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


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: StaticForwardContext) -> Tensor:
    """All rows against the whole key capacity, masked to same-request causal pairs; ``(rows, heads, dim)``."""
    visible = (ctx.query_request[:, None] == ctx.key_request[None, :]) & (
        ctx.key_positions[None, :] <= ctx.query_positions[:, None])
    # Unused key slots hold whatever the scratch slot holds; a masked key still multiplies its value by 0.
    values = torch.where((ctx.key_request >= 0)[:, None, None], values, 0.0)
    group = q.shape[1] // keys.shape[1]
    q_, k_, v_ = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    kwargs: dict[str, object] = {}
    if group > 1:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:  # expand + reshape: fixed shapes, no repeat_interleave
            k_ = k_[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
            v_ = v_[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
    out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=visible[None, None], **kwargs)
    return out[0].transpose(0, 1)
