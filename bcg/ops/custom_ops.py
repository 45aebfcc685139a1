"""How the islands look to ``torch.compile``: opaque custom ops, split points, and islands it cannot trace.

An island is an ``@eager_on_graph`` function whose wrapper reads a ``ContextVar``, which dynamo cannot trace. Each
island therefore gets a stand-in registered with ``torch.compiler.substitute_in_graph``: when dynamo inlines the
island it traces the stand-in, which calls a ``torch.library`` custom op that the compiler treats as opaque (a
fake kernel gives it shapes). Outside ``torch.compile`` nothing changes: calling the island costs no extra check.

* ``bcg::attention`` (mutates ``out``) stands for :func:`bcg.ops.attention.attention` and is a split point:
  the "tc_piecewise" backend cuts the traced graph there and runs the island eagerly between compiled pieces.
  :func:`register_split_op` adds more split points.
* The DSA islands have no opaque op: their stand-ins leave a ``bcg::untraceable`` marker, and the backend refuses
  a graph holding one (:func:`untraceable_islands`) with the reason, instead of failing deep inside dynamo.

Importing this module registers everything (the compiling backends do, when they compile).
"""

# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bcg.ops import dsa
from bcg.ops.attention import attention

__all__ = ["SPLIT_OPS", "is_split_node", "register_split_op", "untraceable_islands"]


@torch.library.custom_op("bcg::attention", mutates_args=("out",))
def attention_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
    """The attention island as an opaque op: reads the current forward context, writes ``out``."""
    attention(q, k, v, out, layer_id)


@attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
    return None


@torch.compiler.substitute_in_graph(attention)
def _trace_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
    torch.ops.bcg.attention(q, k, v, out, layer_id)


# Split points: op overload packet -> the Python function the split graph calls at run time in its place. The
# custom op is for the compiler; going through the dispatcher at run time would cost ~10-20 us per call.
SPLIT_OPS: dict[Any, Callable[..., Any]] = {}


def register_split_op(op: Any, eager_fn: Callable[..., Any]) -> None:
    """Makes ``op`` (a ``torch.ops`` overload packet) a split point run as ``eager_fn`` between compiled pieces.

    Example::

        register_split_op(torch.ops.mylib.all_gather, all_gather)   # all_gather traced as that op
    """
    SPLIT_OPS[op] = eager_fn


def is_split_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a registered split op (packet or overload)."""
    if node.op != "call_function":
        return False
    target = node.target
    return target in SPLIT_OPS or getattr(target, "overloadpacket", None) in SPLIT_OPS


def split_fn(node: torch.fx.Node) -> Callable[..., Any]:
    """The run-time function of a split node."""
    return SPLIT_OPS.get(node.target) or SPLIT_OPS[node.target.overloadpacket]


register_split_op(torch.ops.bcg.attention, attention)


@torch.library.custom_op("bcg::untraceable", mutates_args=("marker",))
def untraceable_op(marker: Tensor, island: str) -> None:
    """Marks where an island without an opaque op was traced; it mutates ``marker`` so no pass removes it."""
    raise RuntimeError(f"{island} has no opaque op for torch.compile; a graph holding it must not run "
                       "(the tc_piecewise backend refuses it at build)")


@untraceable_op.register_fake
def _untraceable_fake(marker: Tensor, island: str) -> None:
    return None


# Island name -> why torch.compile cannot take it.
UNTRACEABLE: dict[str, str] = {
    "bcg.ops.dsa.select_topk": dsa.UNCAPTURABLE,
    "bcg.ops.dsa.sparse_attention": dsa.UNCAPTURABLE,
}


@torch.compiler.substitute_in_graph(dsa.select_topk)
def _trace_select_topk(index_q: Tensor, index_k: Tensor, head_weights: Tensor, group_id: int, topk: int) -> Tensor:
    selection = index_q.new_full((index_q.shape[0], topk), -1, dtype=torch.int64)
    torch.ops.bcg.untraceable(selection, "bcg.ops.dsa.select_topk")
    return selection


@torch.compiler.substitute_in_graph(dsa.sparse_attention)
def _trace_sparse_attention(q: Tensor, k: Tensor, v: Tensor, selection: Tensor, out: Tensor, layer_id: int) -> None:
    torch.ops.bcg.untraceable(out, "bcg.ops.dsa.sparse_attention")


def untraceable_islands(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the islands without an opaque op traced into ``gm``, in graph order, without repeats."""
    names: list[str] = []
    for node in gm.graph.nodes:
        target = getattr(node.target, "overloadpacket", node.target)
        if node.op == "call_function" and target is torch.ops.bcg.untraceable and node.args[1] not in names:
            names.append(node.args[1])
    return names
