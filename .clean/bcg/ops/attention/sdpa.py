"""The reference: per-request SDPA with a bottom-right causal mask, on any device and dtype.

The exact path of the CPU tests and of fp32; also what the varlen island falls back to where FlashAttention's causal
mask turns out top-left aligned.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from bcg.ops.attention.base import AttentionBackend, BatchContext, register_attention_backend
from bcg.ops.attention.gqa import gqa_sdpa

__all__ = ["SdpaAttention", "sdpa_attention"]


@register_attention_backend
class SdpaAttention(AttentionBackend):
    """Per-request SDPA as an eager island (``attention_backend="sdpa"``, the default off CUDA or in fp32).

    Example::

        eng = Engine("tiny-dense", device="cpu", attention_backend="sdpa")
    """

    name = "sdpa"
    is_island = True

    def attend(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        n = ctx.num_tokens
        keys, values = ctx.keys_values(layer_id, k, v)
        if n == ctx.num_padded_tokens:
            out.copy_(sdpa_attention(q, keys, values, ctx))
            return
        out[:n].copy_(sdpa_attention(q[:n], keys, values, ctx))
        out[n:].zero_()


def sdpa_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: BatchContext) -> Tensor:
    """Per-request SDPA of the real queries ``q`` over the packed ``keys``/``values`` (ordered like
    ``ctx.read_slots``), with a bottom-right causal mask; the exact reference on any device."""
    out = torch.empty_like(q)
    q_starts = accumulate(ctx.seq_lens_q, initial=0)
    k_starts = accumulate(ctx.seq_lens_k, initial=0)
    for q_start, k_start, len_q, prefix_len in zip(q_starts, k_starts, ctx.seq_lens_q, ctx.prefix_lens):
        len_k = prefix_len + len_q
        # (L, H, D) -> (1, H, L, D), the layout SDPA wants.
        q_r = q[q_start : q_start + len_q].transpose(0, 1)[None]
        k_r = keys[k_start : k_start + len_k].transpose(0, 1)[None]
        v_r = values[k_start : k_start + len_k].transpose(0, 1)[None]
        # SDPA's is_causal is top-left aligned; a cached prefix needs the bottom-right diagonal.
        mask = {"attn_mask": causal_lower_right(len_q, len_k)} if prefix_len else {"is_causal": True}
        out[q_start : q_start + len_q] = gqa_sdpa(q_r, k_r, v_r, **mask)[0].transpose(0, 1)
    return out
