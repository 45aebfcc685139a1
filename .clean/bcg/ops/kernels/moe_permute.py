# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""The token permutation around the experts: the stable expert order of the (token, choice) pairs with the
per-expert group ends (one kernel on CUDA), and the un-sort with the weighted sum over the k choices (one kernel).

The grouping is exactly ``topk_ids.flatten().sort(stable=True)``: rows are grouped by expert, and inside a group
pairs keep their flat order (token-major), so results do not depend on how a batch is packed. Both fused kernels
are deterministic: integer counting, no atomics, and the combine sums the k choices in order ``j = 0..k-1`` in fp32
(the reference's ``einsum`` leaves its order to the matmul).

Use in an MoE layer::

    order = expert_order(topk_ids, num_experts)
    x_sorted = x[order.token_index]                               # (T * k, H)
    y_sorted = experts(x_sorted, order.group_end)                 # grouped_mm with offs=group_end
    y = moe_combine(y_sorted, order.slot, topk_weights)           # (T, H)
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["ExpertOrder", "expert_order", "expert_order_reference", "moe_combine", "moe_combine_reference"]


class ExpertOrder(NamedTuple):
    """The stable expert order of ``T * k`` (token, choice) pairs.

    ``token_index (T * k,)`` int64: the token of each sorted row (``x_sorted = x[token_index]``);
    ``slot (T, k)`` int64: the sorted row of each pair (the inverse permutation, read by :func:`moe_combine`);
    ``group_end (E,)`` int32: one past each expert's last row (``grouped_mm``'s ``offs``);
    ``expert (T * k,)`` int64: the expert of each sorted row (the sorted ids).
    """

    token_index: Tensor
    slot: Tensor
    group_end: Tensor
    expert: Tensor


def expert_order_reference(topk_ids: Tensor, num_experts: int) -> ExpertOrder:
    """Plain torch: a stable sort of the flattened ids, its inverse, and ``searchsorted`` group ends."""
    num_rows, top_k = topk_ids.shape
    sorted_ids, order = topk_ids.flatten().sort(stable=True)
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device)
    experts = torch.arange(num_experts, device=topk_ids.device, dtype=sorted_ids.dtype)
    group_end = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return ExpertOrder(order // top_k, slot.view(num_rows, top_k), group_end, sorted_ids.to(torch.int64))


def expert_order(topk_ids: Tensor, num_experts: int, *, impl: str = "fused") -> ExpertOrder:
    """The stable expert order of the pairs in ``topk_ids (T, k)`` (int32 or int64, values in ``[0, E)``).

    The fused kernel trusts the ids to be in range (a router's always are); an id outside ``[0, E)`` gets no
    row of its own there, while the reference sorts it past the last group.

    Example:
        >>> order = expert_order(torch.tensor([[2, 0], [0, 1]]), num_experts=3)
        >>> order.token_index.tolist(), order.slot.tolist(), order.group_end.tolist()
        ([0, 1, 1, 0], [[3, 0], [1, 2]], [2, 3, 4])
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, k), got {tuple(topk_ids.shape)}")
    path = kernel_path(impl, topk_ids)
    if path == "torch":
        return expert_order_reference(topk_ids, num_experts)
    if path == "op":
        return ExpertOrder(*torch.ops.bcg.expert_order(topk_ids, num_experts))
    return ExpertOrder(*_expert_order_triton(topk_ids, num_experts))


def moe_combine_reference(y_sorted: Tensor, slot: Tensor, weights: Tensor, bias: Optional[Tensor] = None,
                          row_expert: Optional[Tensor] = None) -> Tensor:
    """Plain torch: un-sort ``y_sorted (T * k, H)`` and sum the k rows of each token weighted by ``weights``, each
    row plus its expert's ``bias`` first (in the rows' dtype, as the module's separate add would)."""
    num_rows, top_k = slot.shape
    rows = slot.flatten()
    y = y_sorted[rows]
    if bias is not None:
        y = y + bias[row_expert[rows]].to(y.dtype)
    return torch.einsum("tkh,tk->th", y.view(num_rows, top_k, y_sorted.shape[1]), weights)


def moe_combine(y_sorted: Tensor, slot: Tensor, weights: Tensor, *, bias: Optional[Tensor] = None,
                row_expert: Optional[Tensor] = None, out: Optional[Tensor] = None, impl: str = "fused") -> Tensor:
    """``out[t] = sum_j weights[t, j] * (y_sorted[slot[t, j]] + bias[e])``: the experts' outputs back in token
    order, ``e = row_expert[slot[t, j]]`` the row's expert (``bias`` None: no bias).

    ``y_sorted (T * k, H)`` (rows may be strided), ``slot (T, k)`` from :func:`expert_order`, ``weights (T, k)``
    from the router; ``bias (E, H)`` the experts' output bias (gpt-oss's down projection's) with ``row_expert
    (T * k,)`` (:attr:`ExpertOrder.expert`): the bias rides the combine instead of a gather and an add of its own.
    Returns ``(T, H)`` in ``y_sorted``'s dtype (or writes ``out``).

    Example:
        >>> y = torch.arange(8.0).view(4, 2)
        >>> moe_combine(y, torch.tensor([[3, 0], [1, 2]]), torch.tensor([[0.5, 0.5], [1.0, 0.0]])).tolist()
        [[3.0, 4.0], [2.0, 3.0]]
    """
    if slot.dim() != 2 or weights.shape != slot.shape or y_sorted.shape[0] != slot.numel():
        raise ValueError(f"moe_combine needs y_sorted (T*k, H), slot and weights (T, k); got {tuple(y_sorted.shape)}, "
                         f"{tuple(slot.shape)}, {tuple(weights.shape)}")
    if (bias is None) != (row_expert is None) or (bias is not None and (
            bias.dim() != 2 or bias.shape[1] != y_sorted.shape[1] or row_expert.shape != (y_sorted.shape[0],))):
        raise ValueError("moe_combine's bias needs row_expert and the reverse: bias (E, H) and row_expert (T*k,), got "
                         f"{None if bias is None else tuple(bias.shape)} and "
                         f"{None if row_expert is None else tuple(row_expert.shape)} for y_sorted "
                         f"{tuple(y_sorted.shape)}")
    path = kernel_path(impl, y_sorted)
    if path == "torch":
        y = moe_combine_reference(y_sorted, slot, weights, bias, row_expert)
        return y if out is None else out.copy_(y)
    if y_sorted.stride(-1) != 1 or (bias is not None and bias.stride(-1) != 1):
        raise ValueError(f"y_sorted and bias must have a contiguous last dimension (strides {y_sorted.stride()})")
    if path == "op":
        y = torch.ops.bcg.moe_combine(y_sorted, slot, weights, bias, row_expert)
        return y if out is None else out.copy_(y)
    from bcg.ops.kernels import triton_moe

    out = _moe_combine_fake(y_sorted, slot, weights) if out is None else out
    triton_moe.combine(y_sorted, slot.contiguous(), weights, out, bias, row_expert)
    return out


# --- The ops (bcg.ops.kernels.library): each allocates its results as its fake kernel does, then fills them. ---
def _expert_order_fake(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n_pairs = topk_ids.numel()
    return (topk_ids.new_empty(n_pairs, dtype=torch.int64), topk_ids.new_empty(topk_ids.shape, dtype=torch.int64),
            topk_ids.new_empty(num_experts, dtype=torch.int32), topk_ids.new_empty(n_pairs, dtype=torch.int64))


def _expert_order_op(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    results = _expert_order_fake(topk_ids, num_experts)
    for result, value in zip(results, expert_order_reference(topk_ids, num_experts)):
        result.copy_(value)
    return results


def _expert_order_triton(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from bcg.ops.kernels import triton_moe

    results = _expert_order_fake(topk_ids, num_experts)
    triton_moe.expert_order(topk_ids.contiguous(), num_experts, *results)
    return results


def _moe_combine_fake(y_sorted: Tensor, slot: Tensor, weights: Tensor, bias: Optional[Tensor] = None,
                      row_expert: Optional[Tensor] = None) -> Tensor:
    return y_sorted.new_empty((slot.shape[0], y_sorted.shape[1]))


def _moe_combine_op(y_sorted: Tensor, slot: Tensor, weights: Tensor, bias: Optional[Tensor] = None,
                    row_expert: Optional[Tensor] = None) -> Tensor:
    return _moe_combine_fake(y_sorted, slot, weights).copy_(
        moe_combine_reference(y_sorted, slot, weights, bias, row_expert))


def _moe_combine_triton(y_sorted: Tensor, slot: Tensor, weights: Tensor, bias: Optional[Tensor] = None,
                        row_expert: Optional[Tensor] = None) -> Tensor:
    from bcg.ops.kernels import triton_moe

    out = _moe_combine_fake(y_sorted, slot, weights)
    triton_moe.combine(y_sorted, slot.contiguous(), weights, out, bias, row_expert)
    return out


kernel_op("expert_order", mutates_args=(), reference=_expert_order_op, triton=_expert_order_triton,
          fake=_expert_order_fake)
kernel_op("moe_combine", mutates_args=(), reference=_moe_combine_op, triton=_moe_combine_triton,
          fake=_moe_combine_fake)
