"""The attention island: KV-cache write plus causal varlen attention over packed requests.

:func:`attention` is an ``@eager_on_graph`` island: it runs eagerly at graph replay and reads the
live :class:`~bcg.runtime.context.ForwardContext`, so one captured graph serves every batch that
fits its bucket. Two implementations compute the same thing:

* CUDA, bf16/fp16: FlashAttention's varlen forward (:mod:`bcg.runtime.flash`) on all requests at
  once, written straight into the island's output rows. Its causal mask must be aligned bottom-right
  when a request has a cached prefix (query ``i`` sees keys ``0..prefix+i``); that is probed once per
  device and, if the kernel turns out top-left aligned, batches with a prefix use the SDPA path instead.
* Everything else (CPU, fp32, no varlen): SDPA per request, with ``causal_lower_right`` for
  requests with a prefix. This is also the exact reference in tests.

The island runs once per layer per replay, so it does as little host work as it can: no slicing or
zeroing when the batch fills its bucket exactly, no output copy where the kernel writes in place.

Under a :class:`~bcg.runtime.static_context.StaticForwardContext` (backend="full", which captures the island
inside its graph) the island takes the fixed-shape path of :mod:`bcg.runtime.static_attention` instead.
"""

from __future__ import annotations

import functools
import logging
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from bcg import eager_on_graph
from bcg.runtime.context import ForwardContext, get_forward_context
from bcg.runtime.flash import flash_varlen, is_varlen_usable, varlen_attn, varlen_causal_is_bottom_right
from bcg.runtime.static_context import StaticForwardContext

__all__ = ["attention", "causal_attention", "flash_varlen", "is_varlen_usable", "sdpa_attention", "varlen_attn",
           "varlen_attention", "varlen_causal_is_bottom_right", "write_and_gather_kv"]

logger = logging.getLogger(__name__)

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@eager_on_graph
def attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
    """Causal self-attention of the current batch, written into ``out``.

    Args:
        q: ``(T_pad, num_heads, head_dim)`` queries (RoPE applied).
        k, v: ``(T_pad, num_kv_heads, head_dim)`` keys/values of the new tokens.
        out: ``(T_pad, num_heads, head_dim)`` output buffer: rows ``[:num_tokens]`` get the
            attention result, padded rows are zeroed.
        layer_id: which layer's KV cache to use.

    Only the real rows ``[:num_tokens]`` are written to the KV pool (at ``ctx.write_slots``);
    each request then attends over its full key range gathered from the pool.

    Example:
        >>> with forward_context(batch.to_context(num_padded_tokens=16)):  # doctest: +SKIP
        ...     attention(q, k, v, out, layer_id=0)
    """
    ctx = get_forward_context()
    if isinstance(ctx, StaticForwardContext):
        # backend="full" captures this island inside its graph: fixed shapes over static metadata buffers.
        from bcg.runtime.static_attention import static_attention  # here: that module imports this one

        static_attention(q, k, v, out, layer_id, ctx)
        return
    num_tokens = ctx.num_tokens
    keys, values = write_and_gather_kv(ctx, layer_id, k, v)
    if num_tokens == ctx.num_padded_tokens:  # the batch fills its bucket: no slices, no padded rows
        causal_attention(q, keys, values, ctx, out=out)
        return
    causal_attention(q[:num_tokens], keys, values, ctx, out=out[:num_tokens])
    out[num_tokens:].zero_()


def write_and_gather_kv(ctx: ForwardContext, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Store the real tokens' K/V at their slots and return every request's keys/values, packed.

    Returns ``(sum of key ranges, num_kv_heads, head_dim)`` tensors ordered like ``ctx.read_slots``.
    """
    num_tokens, pool = ctx.num_tokens, ctx.kv_pool
    k_cache, v_cache = pool.k[layer_id], pool.v[layer_id]
    if num_tokens != k.shape[0]:
        k, v = k[:num_tokens], v[:num_tokens]
    k_cache.index_copy_(0, ctx.write_slots, k)
    v_cache.index_copy_(0, ctx.write_slots, v)
    if not ctx.has_prefix:
        # Key ranges are exactly the new tokens: skip the gather.
        return k, v
    return k_cache[ctx.read_slots], v_cache[ctx.read_slots]


def causal_attention(
    q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext, out: Tensor | None = None
) -> Tensor:
    """Causal attention of the packed real queries ``q`` over the packed ``keys``/``values``.

    Picks varlen (CUDA, half precision) or per-request SDPA; see the module docstring. Writes into ``out``
    (contiguous, shaped like ``q``) when given and returns it.
    """
    use_varlen = is_varlen_usable(q)
    if use_varlen and ctx.has_prefix and not varlen_causal_is_bottom_right(q.device):
        use_varlen = False
    _log_choice(q.device.type, "varlen" if use_varlen else "sdpa")
    if use_varlen:
        return varlen_attention(q, keys, values, ctx, out=out)
    result = sdpa_attention(q, keys, values, ctx)
    if out is None:
        return result
    out.copy_(result)
    return out


def varlen_attention(
    q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext, out: Tensor | None = None
) -> Tensor:
    """All requests in one FlashAttention varlen call (CUDA, fp16/bf16)."""
    return flash_varlen(q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                        is_causal=True, out=out)


def sdpa_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    """Per-request SDPA with a bottom-right causal mask; exact reference on any device."""
    out = torch.empty_like(q)
    group = q.shape[1] // keys.shape[1]
    q_starts = accumulate(ctx.seq_lens_q, initial=0)
    k_starts = accumulate(ctx.seq_lens_k, initial=0)
    for q_start, k_start, len_q, prefix_len in zip(q_starts, k_starts, ctx.seq_lens_q, ctx.prefix_lens):
        len_k = prefix_len + len_q
        # (L, H, D) -> (1, H, L, D), the layout SDPA wants.
        q_r = q[q_start : q_start + len_q].transpose(0, 1)[None]
        k_r = keys[k_start : k_start + len_k].transpose(0, 1)[None]
        v_r = values[k_start : k_start + len_k].transpose(0, 1)[None]
        kwargs: dict[str, object] = {}
        if group > 1:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:
                k_r, v_r = k_r.repeat_interleave(group, dim=1), v_r.repeat_interleave(group, dim=1)
        if prefix_len:
            # SDPA's is_causal is top-left aligned; a cached prefix needs the bottom-right diagonal.
            kwargs["attn_mask"] = causal_lower_right(len_q, len_k)
        else:
            kwargs["is_causal"] = True
        out_r = F.scaled_dot_product_attention(q_r, k_r, v_r, **kwargs)
        out[q_start : q_start + len_q] = out_r[0].transpose(0, 1)
    return out


@functools.cache
def _log_choice(device_type: str, impl: str) -> None:
    logger.info("bcg attention island on %s uses %s", device_type, impl)
