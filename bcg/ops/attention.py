"""The attention island and the live batch it reads: KV-cache write plus causal varlen attention over packed requests.

:func:`attention` is an ``@eager_on_graph`` island: it runs eagerly at graph replay and asks the current forward
context to attend (:mod:`bcg.ops.context`), so one captured graph serves every batch that fits its bucket. Under
the live :class:`BatchContext` two implementations compute the same thing:

* CUDA, bf16/fp16: FlashAttention's varlen forward (:mod:`bcg.ops.flash`) on all requests at once, written
  straight into the island's output rows. Its causal mask must be aligned bottom-right when a request has a cached
  prefix (query ``i`` sees keys ``0..prefix+i``); that is probed once per device and, if the kernel turns out
  top-left aligned, batches with a prefix use the SDPA path instead.
* Everything else (CPU, fp32, no varlen): SDPA per request, with ``causal_lower_right`` for requests with a
  prefix. This is also the exact reference in tests.

The island runs once per layer per replay, so it does as little host work as it can: no slicing or zeroing when the
batch fills its bucket exactly, no output copy where the kernel writes in place. A whole-graph capture installs a
:class:`~bcg.ops.static_attention.StaticContext` instead, whose ``attend`` is fixed-shape.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from bcg import eager_on_graph
from bcg.ops.attention_features import feature_attention
from bcg.ops.context import AttentionFeatures, ForwardContext, get_forward_context
from bcg.ops.flash import flash_varlen, is_varlen_usable, varlen_causal_is_bottom_right
from bcg.ops.kv_cache import KVPool
from bcg.ops.sdpa import gqa_sdpa

__all__ = ["AttentionFeatures", "BatchContext", "attention", "causal_attention", "sdpa_attention",
           "varlen_attention", "write_and_gather_kv"]

logger = logging.getLogger(__name__)


@eager_on_graph
def attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: float | None = None,
              window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None) -> None:
    """Causal self-attention of the current batch, written into ``out``: the island every attention layer calls.

    Args:
        q: ``(T_pad, num_heads, head_dim)`` queries (RoPE applied).
        k, v: ``(T_pad, num_kv_heads, head_dim)`` keys/values of the new tokens (``v`` may have its own head dim).
        out: ``(T_pad, num_heads, v_head_dim)`` output buffer: rows ``[:num_tokens]`` get the attention result,
            padded rows are zeroed.
        layer_id: which layer's KV cache to use.
        scale, window, softcap, sinks: the layer's :class:`~bcg.ops.attention_features.AttentionFeatures` (softmax
            scale, sliding window, logit soft-cap, per-head sink logits); all None for plain causal attention.

    The current forward context decides how (:meth:`BatchContext.attend` for a live batch, or
    :meth:`BatchContext.attend_with` when the layer has features).

    Example::

        with forward_context(batch.to_context(num_padded_tokens=16)):
            attention(q, k, v, out, layer_id=0)
            attention(q, k, v, out, layer_id=1, window=128, sinks=sinks)     # gpt-oss's sliding layers
    """
    ctx = get_forward_context()
    if scale is None and window is None and softcap is None and sinks is None:
        ctx.attend(q, k, v, out, layer_id)
    else:
        ctx.attend_with(q, k, v, out, layer_id, AttentionFeatures(scale, window, softcap, sinks))


@dataclass(frozen=True)
class BatchContext(ForwardContext):
    """Metadata of one packed prefill batch, as the islands read it eagerly (a :class:`ForwardContext`).

    Request ``r`` has ``seq_lens_q[r]`` new tokens after ``prefix_lens[r]`` cached ones; its new tokens occupy rows
    ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]`` of the packed token dimension and its full key range (prefix then
    new) is ``read_slots[cu_seqlens_k[r]:cu_seqlens_k[r + 1]]``. Usually built by
    :meth:`bcg.runtime.batch.PrefillBatch.to_context`.

    Attributes:
        num_tokens: real new tokens in the batch (rows ``[:num_tokens]`` are real).
        num_padded_tokens: rows the layer stack runs on (the captured bucket size).
        seq_lens_q: new tokens per request (host ints).
        prefix_lens: tokens already in the KV pool per request (host ints).
        cu_seqlens_q: int32 ``(R + 1,)`` on device, prefix sums of ``seq_lens_q``.
        cu_seqlens_k: int32 ``(R + 1,)`` on device, prefix sums of ``prefix_lens + seq_lens_q``.
        max_seqlen_q: longest ``seq_lens_q``.
        max_seqlen_k: longest key range.
        write_slots: int64 ``(num_tokens,)`` on device, pool slot of each real new token.
        read_slots: int64 ``(sum of key ranges,)`` on device, each request's prefix slots then its new slots,
            concatenated in request order.
        kv_pool: the pool the islands read and write.

    Example:
        >>> import torch
        >>> from bcg.ops.context import forward_context, get_forward_context
        >>> pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> cu = torch.tensor([0, 3], dtype=torch.int32)
        >>> ctx = BatchContext(3, 4, [3], [0], cu, cu, 3, 3, torch.arange(3), torch.arange(3), pool)
        >>> with forward_context(ctx):
        ...     get_forward_context().num_padded_tokens
        4
    """

    num_tokens: int
    num_padded_tokens: int
    seq_lens_q: list[int]
    prefix_lens: list[int]
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    write_slots: Tensor
    read_slots: Tensor
    kv_pool: KVPool

    def __post_init__(self) -> None:
        if not 0 < self.num_tokens <= self.num_padded_tokens:
            raise ValueError(
                f"need 0 < num_tokens <= num_padded_tokens, got num_tokens={self.num_tokens}, "
                f"num_padded_tokens={self.num_padded_tokens}"
            )

    @property
    def num_requests(self) -> int:
        """Number of requests packed in the batch."""
        return len(self.seq_lens_q)

    @property
    def seq_lens_k(self) -> list[int]:
        """Key range length (prefix + new) per request."""
        return [p + q for p, q in zip(self.prefix_lens, self.seq_lens_q)]

    @functools.cached_property
    def has_prefix(self) -> bool:
        """Whether any request continues from cached tokens (computed once; islands ask every layer)."""
        return any(self.prefix_lens)

    def live(self, island: str, why: str) -> BatchContext:
        """This context: it is the live batch."""
        return self

    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        """Writes the real rows' K/V at their slots, then each request attends over its whole key range.

        Padded rows never touch the KV pool and get zeros in ``out``.
        """
        num_tokens = self.num_tokens
        keys, values = write_and_gather_kv(self, layer_id, k, v)
        if num_tokens == self.num_padded_tokens:  # the batch fills its bucket: no slices, no padded rows
            causal_attention(q, keys, values, self, out=out)
            return
        causal_attention(q[:num_tokens], keys, values, self, out=out[:num_tokens])
        out[num_tokens:].zero_()

    def attend_with(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    features: AttentionFeatures) -> None:
        """:meth:`attend` with a sliding window, sinks, a soft-cap or a scale (:mod:`bcg.ops.attention_features`),
        or a V head dim other than Q's."""
        num_tokens = self.num_tokens
        keys, values = write_and_gather_kv(self, layer_id, k, v)
        feature_attention(q[:num_tokens], keys, values, self, features, out[:num_tokens])
        if num_tokens < self.num_padded_tokens:
            out[num_tokens:].zero_()


def write_and_gather_kv(ctx: BatchContext, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
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
    q: Tensor, keys: Tensor, values: Tensor, ctx: BatchContext, out: Tensor | None = None
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
    q: Tensor, keys: Tensor, values: Tensor, ctx: BatchContext, out: Tensor | None = None
) -> Tensor:
    """All requests in one FlashAttention varlen call (CUDA, fp16/bf16)."""
    return flash_varlen(q, keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                        is_causal=True, out=out)


def sdpa_attention(q: Tensor, keys: Tensor, values: Tensor, ctx: BatchContext) -> Tensor:
    """Per-request SDPA with a bottom-right causal mask; exact reference on any device."""
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


@functools.cache
def _log_choice(device_type: str, impl: str) -> None:
    logger.info("bcg attention island on %s uses %s", device_type, impl)
