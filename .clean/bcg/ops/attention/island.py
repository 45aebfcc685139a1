"""The attention call every model makes: the K/V write inside the graph segment, then the kernel, as an island or
captured, as the installed forward context says.

:func:`attention` is what a layer calls. It writes the layer's K/V into the pool (a fixed-shape op, so a graph
captures it: padded rows write the scratch slot) and then attends: inside the graph when the context's backend reads
only fixed-size device fields (:class:`~bcg.ops.attention.static.StaticContext`), else through
:func:`attention_island`, the ``@eager_on_graph`` function that runs at every replay over the live batch. The island
therefore launches only what must stay eager: the attention kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bcg.islands import eager_on_graph
from bcg.ops.context import AttentionFeatures, ForwardContext, get_forward_context

__all__ = ["attention", "attention_island", "kv_destination"]


def attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: float | None = None,
              window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
              kv_stored: bool = False) -> None:
    """Causal self-attention of the current batch, written into ``out``, and the layer's K/V into the pool.

    Args:
        q: ``(T_pad, num_heads, head_dim)`` queries (RoPE applied).
        k, v: ``(T_pad, num_kv_heads, head_dim)`` keys/values of the new tokens (``v`` may have its own head dim).
        out: ``(T_pad, num_heads, v_head_dim)``: rows ``[:num_tokens]`` get the attention result; padded rows get
            finite values (zeros, or the padded rows attending among themselves).
        layer_id: which layer's KV cache to use.
        scale, window, softcap, sinks: the layer's :class:`~bcg.ops.context.AttentionFeatures` (softmax scale,
            sliding window, logit soft-cap, per-head sink logits); all None for plain causal attention.
        kv_stored: the caller's kernel already wrote ``k``/``v`` where :func:`kv_destination` said (the fused RoPE
            kernel does), so the K/V write is skipped.

    Example::

        with forward_context(batch.to_context(num_padded_tokens=16)):
            attention(q, k, v, out, layer_id=0)
            attention(q, k, v, out, layer_id=1, window=128, sinks=sinks)     # gpt-oss's sliding layers
    """
    ctx = get_forward_context()
    if not kv_stored:
        ctx.store_kv(layer_id, k, v)
    if ctx.attends_in_graph:
        _attend(ctx, q, k, v, out, layer_id, scale, window, softcap, sinks)
    else:
        attention_island(q, k, v, out, layer_id, scale, window, softcap, sinks, ctx.write_slots)


def kv_destination(layer_id: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """Where layer ``layer_id``'s K/V go: ``(k_cache, v_cache, slots)``, one slot per row of the forward (padded rows:
    the scratch slot), for a kernel that writes them itself (then call :func:`attention` with ``kv_stored=True``);
    None when the current context keeps them another way, or while torch.compile traces (a context variable cannot
    be traced: the compiled stack writes its K/V in :func:`attention`).

    Example::

        dest = kv_destination(layer_id)
        q, k, v = qkv_norm_rope(qkv, positions, inv_freq, heads, kv_heads, out=bridged, cache=dest)
        attention(q, k, v, out, layer_id, kv_stored=dest is not None)
    """
    if torch.compiler.is_compiling():
        return None
    return get_forward_context().kv_destination(layer_id)


@eager_on_graph
def attention_island(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                     write_slots: Tensor | None = None) -> None:
    """The attention kernel over the live batch (the K/V are already in the pool), run eagerly at every replay.

    ``write_slots`` are the slots the K/V write before it used: at replay they are the ones the graph captured, and
    the live context must have the same tensor, or the graph wrote this batch's K/V where an earlier batch's go.
    """
    ctx = get_forward_context()
    if write_slots is not None and ctx.write_slots.data_ptr() != write_slots.data_ptr():
        raise RuntimeError(
            "the forward context's write slots are not the ones this graph was captured with, so the captured K/V "
            "write stored this batch's keys at another batch's slots. Load every batch of a graph into the fields "
            "it was captured against (one Layout of a MetadataArena, as the runner's StaticInputs does), not into "
            "fresh ones (PrefillBatch.to_context)")
    _attend(ctx, q, k, v, out, layer_id, scale, window, softcap, sinks)


def _attend(ctx: ForwardContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: float | None,
            window: int | None, softcap: float | None, sinks: Tensor | None) -> None:
    if scale is None and window is None and softcap is None and sinks is None:
        ctx.attend(q, k, v, out, layer_id)
    else:
        ctx.attend_with(q, k, v, out, layer_id, AttentionFeatures(scale, window, softcap, sinks))
