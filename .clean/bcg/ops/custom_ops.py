"""How the islands look to ``torch.compile``: opaque custom ops, and which of them a compiled graph may split at.

An island is an ``@eager_on_graph`` function whose wrapper reads a ``ContextVar``, which dynamo cannot trace. Each
island therefore gets a stand-in registered with ``torch.compiler.substitute_in_graph``: when dynamo inlines the
island it traces the stand-in, which calls a ``torch.library`` custom op that the compiler treats as opaque (a fake
kernel gives it shapes). The op's implementation is the island itself, so compiled code that calls it during a
breakable capture makes a break there, exactly as uncompiled code does. Outside ``torch.compile`` nothing changes:
calling an island costs no extra check.

* ``bcg::attention`` (mutates ``out``) stands for :func:`bcg.ops.attention.attention` and is a split point: the
  "tc_piecewise" backend cuts the traced graph there and runs the island eagerly between compiled pieces.
  :func:`register_split_op` adds more split points.
* ``bcg::select_topk`` stands for the DSA indexer island (:mod:`bcg.ops.dsa`). It is not a split point: a piecewise
  graph would capture it inside a piece, which its data-dependent shapes forbid, so "tc_piecewise" refuses a graph
  holding one (:func:`unsplittable_islands`) with the reason. A breakable graph breaks at every island, split point
  or not. ``bcg::sparse_attention`` (DSA attention over the picks) is opaque only because it reads the forward
  context; its shapes are fixed, so it is no island and a graph captures it.

Importing this module registers everything (the compiling backends do, when they compile).
"""

# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from bcg.ops import dsa
from bcg.ops.attention import attention

__all__ = ["ISLAND_OPS", "SPLIT_OPS", "UNSPLITTABLE", "is_island_node", "is_split_node", "island_fn",
           "register_island_op", "register_split_op", "unsplittable_islands"]


# The attention features (scale, window, softcap, sinks) are part of the op's schema, so a compiled graph keeps them.
@torch.library.custom_op("bcg::attention", mutates_args=("out",))
def attention_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: Optional[float] = None,
                 window: Optional[int] = None, softcap: Optional[float] = None,
                 sinks: Optional[Tensor] = None, kv_stored: bool = False) -> None:
    """The attention island as an opaque op: reads the current forward context, writes ``out``."""
    attention(q, k, v, out, layer_id, scale, window, softcap, sinks, kv_stored)


@attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: Optional[float] = None,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[Tensor] = None, kv_stored: bool = False) -> None:
    return None


@torch.compiler.substitute_in_graph(attention)
def _trace_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: Optional[float] = None,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[Tensor] = None, kv_stored: bool = False) -> None:
    torch.ops.bcg.attention(q, k, v, out, layer_id, scale, window, softcap, sinks, kv_stored)


@torch.library.custom_op("bcg::select_topk", mutates_args=())
def select_topk_op(index_q: Tensor, index_k: Tensor, head_weights: Tensor, group_id: int, topk: int,
                   impl: str = "torch") -> Tensor:
    """The DSA indexer island as an opaque op: the top keys of every query, ``(T_pad, topk)`` int64."""
    return dsa.select_topk(index_q, index_k, head_weights, group_id, topk, impl)


@select_topk_op.register_fake
def _select_topk_fake(index_q: Tensor, index_k: Tensor, head_weights: Tensor, group_id: int, topk: int,
                      impl: str = "torch") -> Tensor:
    return index_q.new_empty((index_q.shape[0], topk), dtype=torch.int64)


@torch.compiler.substitute_in_graph(dsa.select_topk)
def _trace_select_topk(index_q: Tensor, index_k: Tensor, head_weights: Tensor, group_id: int, topk: int,
                       impl: str = "torch") -> Tensor:
    return torch.ops.bcg.select_topk(index_q, index_k, head_weights, group_id, topk, impl)


@torch.library.custom_op("bcg::sparse_attention", mutates_args=("out",))
def sparse_attention_op(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor, layer_id: int) -> None:
    """The DSA sparse attention as an opaque op (it reads the forward context): writes ``out``."""
    dsa.sparse_attention(q, k, v, plan, out, layer_id)


@sparse_attention_op.register_fake
def _sparse_attention_fake(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor, layer_id: int) -> None:
    return None


@torch.compiler.substitute_in_graph(dsa.sparse_attention)
def _trace_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor, layer_id: int) -> None:
    torch.ops.bcg.sparse_attention(q, k, v, plan, out, layer_id)


# Op overload packet -> the island's Python function. A compiled graph that runs islands itself (not through the
# dispatcher) calls these: the dispatcher round trip would cost ~10-20 us per call, and under the CPU emulation an
# op seen by its dispatch mode could not end the segment it is recording.
ISLAND_OPS: dict[Any, Callable[..., Any]] = {
    torch.ops.bcg.attention: attention,
    torch.ops.bcg.select_topk: dsa.select_topk,
}
# Split points of "tc_piecewise" (a subset of the islands).
SPLIT_OPS: dict[Any, Callable[..., Any]] = {}
# Island op name -> why a piecewise graph cannot hold it.
UNSPLITTABLE: dict[str, str] = {"bcg.select_topk": dsa.UNCAPTURABLE}


def register_island_op(op: Any, eager_fn: Callable[..., Any], unsplittable: str | None = None) -> None:
    """Makes ``op`` (a ``torch.ops`` overload packet) an island run as ``eager_fn`` where a graph runs islands
    itself; ``unsplittable`` says why a piecewise graph cannot hold it (it is then refused by name there).

    Example::

        register_island_op(torch.ops.mylib.topk, topk, unsplittable="its output shape depends on the data")
    """
    ISLAND_OPS[op] = eager_fn
    if unsplittable is not None:
        UNSPLITTABLE[str(op)] = unsplittable


def register_split_op(op: Any, eager_fn: Callable[..., Any]) -> None:
    """Makes ``op`` (a ``torch.ops`` overload packet) an island and a split point run as ``eager_fn``.

    Example::

        register_split_op(torch.ops.mylib.all_gather, all_gather)   # all_gather traced as that op
    """
    ISLAND_OPS[op] = SPLIT_OPS[op] = eager_fn


register_split_op(torch.ops.bcg.attention, attention)


def _packet(node: torch.fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target) if node.op == "call_function" else None


def is_split_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a registered split op (packet or overload)."""
    return _packet(node) in SPLIT_OPS


def is_island_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an island op."""
    return _packet(node) in ISLAND_OPS


def island_fn(node: torch.fx.Node) -> Callable[..., Any]:
    """The island's Python function for an island node."""
    return ISLAND_OPS[_packet(node)]


def unsplittable_islands(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the island ops in ``gm`` that are not split points (``bcg.select_topk``...), in order, no repeats."""
    names: list[str] = []
    for node in gm.graph.nodes:
        if is_island_node(node) and not is_split_node(node):
            name = str(_packet(node))  # "bcg.select_topk"
            if name not in names:
                names.append(name)
    return names
