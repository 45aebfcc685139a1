# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""Islands whose layer comes from the compiled region being run, not from a constant baked into the trace.

A layer compiled once and reused for every layer of the same structure ("regional compilation") must not bake its
layer's index into the graph: dynamo guards on an int attribute such as ``layer_id``, so every layer would compile
again. Inside a region the models therefore call :func:`region_attention` (and the DSA pair) without a layer index;
the eager loop that runs the regions says which layer is running (:func:`at_layer`), and the op reads it when it
runs. The ops are opaque to the compiler like the other islands (:mod:`bcg.ops.custom_ops`). Attention and the DSA
top-k call their ``@eager_on_graph`` island with the concrete index, so a compiled region called during a breakable
capture breaks there and the captured eager step holds that index: a replay needs no loop and no cursor. The DSA
sparse attention has fixed shapes and is no island: called during a capture it reads the running layer's pool slices
and its kernels go into the segment, as they do uncompiled (as an island it cost glm-dsa's compiled replay 24 eager
calls of about 0.5 ms each at 512 tokens on the H200).

Example::

    with at_layer(LayerIds(attention=3)):
        region(layer, hidden)          # a compiled layer calling region_attention(q, k, v, out)
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor

from bcg.ops import custom_ops, dsa
from bcg.ops.attention import attention
from bcg.ops.context import LayerIds, current_forward_context, forward_state

__all__ = ["LayerIds", "at_layer", "current_layer", "region_attention", "region_select_topk",
           "region_sparse_attention"]


@contextmanager
def at_layer(ids: LayerIds) -> Iterator[None]:
    """Inside the block, region islands use ``ids`` (held by the current forward context)."""
    with forward_state(layer=ids):
        yield


def current_layer() -> LayerIds:
    """The ids of the layer whose region is running.

    Raises:
        RuntimeError: no region is running (a region island was called outside :func:`at_layer`).
    """
    ctx = current_forward_context()
    ids = ctx.layer if ctx is not None else None
    if ids is None:
        raise RuntimeError("a region island ran outside a compiled layer region (no at_layer(...) around it)")
    return ids


def _layer_field(name: str) -> int:
    value = getattr(current_layer(), name)
    if value is None:
        raise RuntimeError(f"the running layer region has no {name} id")
    return value


# --- what runs: the islands with the running layer's ids --------------------------------------------------------
def _attention_here(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: Optional[float] = None,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[Tensor] = None) -> None:
    attention(q, k, v, out, _layer_field("attention"), scale, window, softcap, sinks)


def _select_topk_here(index_q: Tensor, index_k: Tensor, head_weights: Tensor, topk: int,
                      impl: str = "torch") -> Tensor:
    return dsa.select_topk(index_q, index_k, head_weights, _layer_field("index_group"), topk, impl)


def _sparse_attention_here(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor) -> None:
    # Not an island: its shapes are fixed, so a breakable capture records its kernels in the segment (as it does
    # uncompiled), reading the running layer's pool slices at capture; a replay needs neither the loop nor the layer.
    dsa.sparse_attention(q, k, v, plan, out, _layer_field("attention"))


# --- the opaque ops a compiled region calls ----------------------------------------------------------------------
@torch.library.custom_op("bcg::region_attention", mutates_args=("out",))
def _region_attention_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: Optional[float] = None,
                         window: Optional[int] = None, softcap: Optional[float] = None,
                         sinks: Optional[Tensor] = None) -> None:
    _attention_here(q, k, v, out, scale, window, softcap, sinks)


@_region_attention_op.register_fake
def _region_attention_fake(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: Optional[float] = None,
                           window: Optional[int] = None, softcap: Optional[float] = None,
                           sinks: Optional[Tensor] = None) -> None:
    return None


@torch.library.custom_op("bcg::region_select_topk", mutates_args=())
def _region_select_topk_op(index_q: Tensor, index_k: Tensor, head_weights: Tensor, topk: int,
                           impl: str = "torch") -> Tensor:
    return _select_topk_here(index_q, index_k, head_weights, topk, impl)


@_region_select_topk_op.register_fake
def _region_select_topk_fake(index_q: Tensor, index_k: Tensor, head_weights: Tensor, topk: int,
                             impl: str = "torch") -> Tensor:
    return index_q.new_empty((index_q.shape[0], topk), dtype=torch.int64)


@torch.library.custom_op("bcg::region_sparse_attention", mutates_args=("out",))
def _region_sparse_attention_op(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor) -> None:
    _sparse_attention_here(q, k, v, plan, out)


@_region_sparse_attention_op.register_fake
def _region_sparse_attention_fake(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor) -> None:
    return None


# A graph that runs islands itself (compile="traced") calls these functions in place of the ops.
custom_ops.register_island_op(torch.ops.bcg.region_attention, _attention_here)
custom_ops.register_island_op(torch.ops.bcg.region_select_topk, _select_topk_here, unsplittable=dsa.UNCAPTURABLE)
custom_ops.register_island_op(torch.ops.bcg.region_sparse_attention, _sparse_attention_here,
                              unsplittable=dsa.UNCAPTURABLE)


# --- what the models call inside a region ------------------------------------------------------------------------
def region_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: Optional[float] = None,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[Tensor] = None) -> None:
    """:func:`bcg.ops.attention.attention` for the running layer (traced as ``bcg::region_attention``)."""
    if torch.compiler.is_compiling():
        torch.ops.bcg.region_attention(q, k, v, out, scale, window, softcap, sinks)
    else:
        _attention_here(q, k, v, out, scale, window, softcap, sinks)


def region_select_topk(index_q: Tensor, index_k: Tensor, head_weights: Tensor, topk: int,
                       impl: str = "torch") -> Tensor:
    """:func:`bcg.ops.dsa.select_topk` for the running layer's index group."""
    if torch.compiler.is_compiling():
        return torch.ops.bcg.region_select_topk(index_q, index_k, head_weights, topk, impl)
    return _select_topk_here(index_q, index_k, head_weights, topk, impl)


def region_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor) -> None:
    """:func:`bcg.ops.dsa.sparse_attention` for the running layer (traced as ``bcg::region_sparse_attention``;
    captured in the segment, not an island)."""
    if torch.compiler.is_compiling():
        torch.ops.bcg.region_sparse_attention(q, k, v, plan, out)
    else:
        _sparse_attention_here(q, k, v, plan, out)
