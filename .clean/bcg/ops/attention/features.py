"""Attention with the features some models add to plain causal attention, over the live batch.

* a sliding window ``W``: query at position ``p`` sees keys at positions ``p - W + 1 .. p`` (itself and the ``W - 1``
  before it, as transformers' sliding-window mask), also across a cached prefix;
* attention sinks (gpt-oss): one learned logit per head that joins every softmax as an extra column with no value;
* logit soft-capping (gemma2): ``cap * tanh(logits / cap)`` before the softmax;
* a softmax scale other than ``head_dim ** -0.5``, and a V head dim other than Q/K's.

Two implementations compute the same thing:

* CUDA, bf16/fp16, no soft-cap, equal head dims: one FlashAttention varlen call with the window as its left window
  size, returning the log-sum-exp; sinks are then one elementwise kernel, since a softmax over ``[logits, s]``
  with the sink column dropped is ``softmax(logits) @ V * sigmoid(lse - s)``. A once-per-device probe checks this
  path against the reference before it is used; if the aten op lacks the window argument or disagrees, the
  reference runs instead (logged).
* Everything else (CPU, fp32, soft-cap, which torch's FlashAttention does not implement): per request, SDPA with a
  boolean mask, or the logits in fp32 when soft-capping or sinks need them. This is the exact reference.
"""

from __future__ import annotations

import functools
import logging
import math
from itertools import accumulate
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.errors import first_line
from bcg.ops.context import AttentionFeatures, ForwardContext
from bcg.ops.flash import flash_varlen_lse, runs_flash_varlen, varlen_causal_is_bottom_right

__all__ = ["AttentionFeatures", "feature_attention", "request_attention", "visible_keys"]

logger = logging.getLogger(__name__)


def feature_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext, features: AttentionFeatures,
                      out: Tensor, flash: bool = True) -> None:
    """Causal attention with ``features`` of the real queries ``q`` over every request's packed ``keys``/``values``
    (ordered like ``ctx.read_slots``), written into ``out`` (``(len(q), num_heads, v_head_dim)``).

    ``flash`` is the attention backend's say (the varlen backend's is True, the reference's False); FlashAttention
    runs only where it also covers the features and agrees with the reference on this device."""
    if flash and _use_flash(q, values, ctx, features):
        _log_choice(q.device.type, "FlashAttention varlen (window, sinks via the log-sum-exp)")
        _flash(q, keys, values, ctx, features, out)
        return
    _log_choice(q.device.type, "per-request SDPA / fp32 math")
    reference_attention(q, keys, values, ctx, features, out)


def _use_flash(q: Tensor, values: Tensor, ctx: ForwardContext, features: AttentionFeatures) -> bool:
    if features.softcap is not None or values.shape[-1] != q.shape[-1] or not runs_flash_varlen(q.device, q.dtype):
        return False
    if ctx.has_prefix and not varlen_causal_is_bottom_right(q.device):
        return False
    return flash_features_usable(q.device)


def _flash(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext, features: AttentionFeatures,
           out: Tensor) -> None:
    window_left = None if features.window is None else features.window - 1
    lse = flash_varlen_lse(q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                           out, scale=features.scale, window_left=window_left)
    if lse is None:  # cannot happen after the probe passed; never compute something else silently
        raise RuntimeError("FlashAttention varlen with a window / log-sum-exp became unavailable")
    if features.sinks is not None:
        # softmax over [logits, sink] without the sink column = softmax(logits) @ V * sigmoid(lse - sink)
        gate = torch.sigmoid(lse - features.sinks.float())  # (rows, heads)
        torch.mul(out, gate[..., None], out=out)


def reference_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: ForwardContext, features: AttentionFeatures,
                        out: Tensor) -> None:
    """Per request: SDPA, or fp32 math for soft-capping and sinks (the exact reference, any device)."""
    scale = features.scale if features.scale is not None else q.shape[-1] ** -0.5
    q_starts = accumulate(ctx.seq_lens_q, initial=0)
    k_starts = accumulate(ctx.seq_lens_k, initial=0)
    for q0, k0, len_q, prefix in zip(q_starts, k_starts, ctx.seq_lens_q, ctx.prefix_lens):
        len_k = prefix + len_q
        allowed = visible_keys(len_q, prefix, features.window, q.device)
        out[q0 : q0 + len_q] = request_attention(q[q0 : q0 + len_q], keys[k0 : k0 + len_k], values[k0 : k0 + len_k],
                                                 allowed, scale, features.softcap, features.sinks)


def visible_keys(len_q: int, prefix: int, window: int | None, device: torch.device | str) -> Tensor:
    """``(len_q, prefix + len_q)`` bool: which keys each new query sees (causal from the bottom right, and within
    the window when one is given).

    Example:
        >>> visible_keys(2, 2, 2, "cpu").int().tolist()
        [[0, 1, 1, 0], [0, 0, 1, 1]]
    """
    q_pos = torch.arange(prefix, prefix + len_q, device=device)[:, None]
    k_pos = torch.arange(prefix + len_q, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def request_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, softcap: float | None = None,
                      sinks: Tensor | None = None) -> Tensor:
    """One request: ``q (Lq, H, Dk)``, ``k (Lk, Hkv, Dk)``, ``v (Lk, Hkv, Dv)``, ``allowed (Lq, Lk)`` bool ->
    ``(Lq, H, Dv)`` in ``q.dtype``. Query heads share K/V heads in consecutive groups (GQA).

    Example:
        >>> q, kv = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
        >>> request_attention(q, kv, kv, visible_keys(3, 0, None, "cpu"), 8 ** -0.5).shape
        torch.Size([3, 4, 8])
    """
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, L, D)
    if group > 1:
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=allowed, scale=scale)[0]
        return o.transpose(0, 1)
    logits = (qh.float() @ kh.float().transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    o = torch.exp(logits - lse) @ vh.float()
    if sinks is not None:
        o = o * torch.sigmoid(lse - sinks.float()[:, None, None])
    return o.to(q.dtype).transpose(0, 1)


_FLASH_FEATURES_OK: dict[torch.device, bool] = {}


def flash_features_usable(device: torch.device) -> bool:
    """Whether the FlashAttention path with a window and the log-sum-exp agrees with the reference on ``device``
    (probed once per device, eagerly; never inside a stream capture, where the reference is used)."""
    ok = _FLASH_FEATURES_OK.get(device)
    if ok is not None:
        return ok
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    _FLASH_FEATURES_OK[device] = ok = _probe(device)
    return ok


def _probe(device: torch.device) -> bool:
    """A packed batch with a prefix and a one-token request, window 3, sinks and a scale, both ways."""
    gen = torch.Generator(device=device).manual_seed(0)
    lens_q, prefixes = [3, 1, 4], [2, 0, 5]
    total_q, total_k = sum(lens_q), sum(lens_q) + sum(prefixes)
    dt = torch.bfloat16
    q = torch.randn(total_q, 4, 64, device=device, dtype=dt, generator=gen)
    k, v = (torch.randn(total_k, 2, 64, device=device, dtype=dt, generator=gen) for _ in range(2))
    cu_q = torch.tensor([0, 3, 4, 8], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 15], device=device, dtype=torch.int32)
    # The live metadata these paths read (a BatchContext has more; this module sits below it).
    ctx = SimpleNamespace(num_tokens=total_q, seq_lens_q=lens_q, prefix_lens=prefixes, cu_seqlens_q=cu_q,
                          cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=9,
                          seq_lens_k=[p + n for p, n in zip(prefixes, lens_q)], has_prefix=True)
    features = AttentionFeatures(scale=0.1, window=3, sinks=torch.randn(4, device=device, generator=gen))
    try:
        got, want = torch.empty_like(q), torch.empty_like(q)
        _flash(q, k, v, ctx, features, got)
        reference_attention(q, k, v, ctx, features, want)
        ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=0)
        reason = "" if ok else f"it differs from the reference by {(got.float() - want.float()).abs().max():.3g}"
    except (RuntimeError, TypeError) as e:
        ok, reason = False, first_line(e)
    if ok:
        logger.info("bcg: sliding windows and sinks use FlashAttention varlen on %s", device)
    else:
        logger.warning("bcg: sliding windows and sinks run per request on %s (slower): FlashAttention with a "
                       "window and the log-sum-exp is not usable in this torch build: %s", device, reason)
    return ok


@functools.cache
def _log_choice(device_type: str, impl: str) -> None:
    logger.info("bcg attention with window/sinks/soft-cap on %s uses %s", device_type, impl)
