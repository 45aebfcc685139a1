"""The attention island: KV-cache write plus causal varlen attention over packed requests.

:func:`attention` is an ``@eager_on_graph`` island: it runs eagerly at graph replay and reads the
live :class:`~bcg.runtime.context.ForwardContext`, so one captured graph serves every batch that
fits its bucket. Two implementations compute the same thing:

* CUDA, bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention) on all requests at
  once. Its causal mask must be aligned bottom-right when a request has a cached prefix (query
  ``i`` sees keys ``0..prefix+i``); that is probed once per device and, if the kernel turns out
  top-left aligned, batches with a prefix use the SDPA path instead.
* Everything else (CPU, fp32, no varlen): SDPA per request, with ``causal_lower_right`` for
  requests with a prefix. This is also the exact reference in tests.

Under a :class:`~bcg.runtime.static_context.StaticForwardContext` (backend="full", which captures the island
inside its graph) the island takes the fixed-shape path of :mod:`bcg.runtime.static_attention` instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from bcg import eager_on_graph
from bcg.runtime.context import ForwardContext, get_forward_context
from bcg.runtime.static_context import StaticForwardContext

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without the varlen API
    varlen_attn = None

logger = logging.getLogger(__name__)

# Keyword spellings differ across torch versions: read them once from the signature.
_VARLEN_PARAMS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
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
    out[:num_tokens] = causal_attention(q[:num_tokens], keys, values, ctx)
    out[num_tokens:].zero_()


def write_and_gather_kv(ctx: ForwardContext, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Store the real tokens' K/V at their slots and return every request's keys/values, packed.

    Returns ``(sum of key ranges, num_kv_heads, head_dim)`` tensors ordered like ``ctx.read_slots``.
    """
    num_tokens, pool = ctx.num_tokens, ctx.kv_pool
    k_cache, v_cache = pool.k[layer_id], pool.v[layer_id]
    k_cache.index_copy_(0, ctx.write_slots, k[:num_tokens])
    v_cache.index_copy_(0, ctx.write_slots, v[:num_tokens])
    if not ctx.has_prefix:
        # Key ranges are exactly the new tokens: skip the gather.
        return k[:num_tokens], v[:num_tokens]
    return k_cache[ctx.read_slots], v_cache[ctx.read_slots]


def causal_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    """Causal attention of the packed real queries ``q`` over the packed ``keys``/``values``.

    Picks varlen (CUDA, half precision) or per-request SDPA; see the module docstring.
    """
    use_varlen = is_varlen_usable(q)
    if use_varlen and ctx.has_prefix and not varlen_causal_is_bottom_right(q.device):
        use_varlen = False
    _log_choice(q.device.type, "varlen_attn" if use_varlen else "sdpa")
    return varlen_attention(q, keys, values, ctx) if use_varlen else sdpa_attention(q, keys, values, ctx)


def varlen_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext) -> Tensor:
    """All requests in one ``varlen_attn`` call (CUDA, fp16/bf16)."""
    return flash_varlen(
        q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, is_causal=True
    )


def is_varlen_usable(q: Tensor) -> bool:
    """Whether :func:`flash_varlen` can run on ``q`` (CUDA, fp16/bf16, torch with varlen_attn)."""
    return varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, *, is_causal: bool,
) -> Tensor:
    """``varlen_attn`` with the causal and GQA keywords this torch version spells.

    Causal is bottom-right aligned per sequence (see :func:`varlen_causal_is_bottom_right`). GQA:
    newer versions need ``enable_gqa=True``; older ones accept fewer KV heads as they are.
    """
    if varlen_attn is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available in this torch build")
    kwargs: dict[str, object] = {}
    if is_causal:
        kwargs.update({"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True})
    if "enable_gqa" in _VARLEN_PARAMS and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


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
def varlen_causal_is_bottom_right(device: torch.device) -> bool:
    """Whether ``varlen_attn``'s causal mask is bottom-right aligned when keys outnumber queries.

    One query and two keys with equal scores: bottom-right alignment lets the query see both
    (output = mean of the values = 0.5), top-left only the first (output = 0). Runs once per
    device, eagerly (islands never run under capture).
    """
    head_dim = 64
    q = torch.zeros(1, 1, head_dim, device=device, dtype=torch.bfloat16)
    keys = torch.zeros(2, 1, head_dim, device=device, dtype=torch.bfloat16)
    values = torch.stack([torch.zeros(1, head_dim), torch.ones(1, head_dim)]).to(device, torch.bfloat16)
    cu_q = torch.tensor([0, 1], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 2], device=device, dtype=torch.int32)
    out = flash_varlen(q, keys, values, cu_q, cu_k, 1, 2, is_causal=True)
    is_bottom_right = bool(out.float().mean() > 0.25)
    logger.info("varlen_attn causal mask is %s-aligned on %s", "bottom-right" if is_bottom_right else "top-left", device)
    return is_bottom_right


@functools.cache
def _log_choice(device_type: str, impl: str) -> None:
    logger.info("bcg attention island on %s uses %s", device_type, impl)
