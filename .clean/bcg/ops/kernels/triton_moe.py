"""Triton kernels behind :mod:`bcg.ops.kernels.moe_router` and :mod:`bcg.ops.kernels.moe_permute`.

* router: one program per token: the experts' scores (softmax, raw logits or sigmoid with a correction bias and
  group selection), k rounds of arg-max, the weights (softmax over the k, renormalisation, scaling), shared columns.
* expert order: a stable counting sort of the ``T * k`` (token, choice) pairs by expert without atomics. Program
  ``c`` owns a chunk of pairs; it counts every expert over all pairs and over the pairs before its chunk (integer
  histograms: order-free, so deterministic), which gives its chunk's first row in each expert group, then ranks its
  pairs inside the chunk with a prefix sum. Stable by construction: a pair's row is the number of pairs with a
  smaller expert plus the number of earlier pairs with the same expert, exactly ``sort(stable=True)``.
* combine: one program per (token, column block): ``sum_j (y[slot[t, j]] + b[e]) * w[t, j]`` in fp32, in order
  j = 0..k-1 (``b`` the row's expert's output bias, where there is one).

Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import exp_f32, grid_dependency, launch, launch_options, launch_rows

_HIST_ELEMENTS = 4096  # pairs per histogram step
_RANK_ELEMENTS = 8192  # chunk * padded experts: the one-hot tile a program ranks at once


@triton.jit
def _router_topk_kernel(
    logits_ptr, logits_stride, bias_ptr, w_ptr, ids_ptr, n_experts, group_size, scaling,
    TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, RULE: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, E_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_BLOCK)
    valid = e < n_experts
    logits = tl.load(logits_ptr + t * logits_stride + e, mask=valid, other=float("-inf")).to(tl.float32)
    if RULE == 0:  # softmax_topk: the choice is the probability itself
        scores = tl.where(valid, exp_f32(logits - tl.max(logits, axis=0)), 0.0)
        scores = tl.div_rn(scores, tl.sum(scores, axis=0))
        choice = scores
    elif RULE == 1:  # topk_softmax: the k largest logits, softmax over them below
        scores = logits
        choice = logits
    else:  # sigmoid_topk: 1 / (1 + exp(-x)) as torch's sigmoid, the correction bias only in the choice
        scores = tl.div_rn(1.0, 1.0 + exp_f32(-logits))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        if N_GROUP > 1:  # only the best TOPK_GROUP groups (by the sum of their two best) may be chosen
            grp = e // group_size
            g = tl.arange(0, G_BLOCK)
            group_score = tl.full([G_BLOCK], float("-inf"), tl.float32)
            for i in tl.static_range(N_GROUP):
                c = tl.where(valid & (grp == i), choice, float("-inf"))
                first = tl.max(c, axis=0)
                first_i = tl.min(tl.where(c == first, e, E_BLOCK), axis=0)
                second = tl.max(tl.where(e == first_i, float("-inf"), c), axis=0)
                group_score = tl.where(g == i, first + second, group_score)
            group_taken = g >= N_GROUP
            keep = e < 0
            for _ in tl.static_range(TOPK_GROUP):
                gc = tl.where(group_taken, float("-inf"), group_score)
                best = tl.max(gc, axis=0)
                best_g = tl.min(tl.where(~group_taken & (gc == best), g, G_BLOCK), axis=0)
                group_taken = group_taken | (g == best_g)
                keep = keep | (grp == best_g)
            choice = tl.where(keep, choice, float("-inf"))
    choice = tl.where(valid, choice, float("-inf"))
    k = tl.arange(0, K_BLOCK)
    top_w = tl.zeros([K_BLOCK], dtype=tl.float32)
    top_i = tl.zeros([K_BLOCK], dtype=tl.int32)
    taken = e >= n_experts  # experts past the end are never chosen
    total = tl.sum(top_w, axis=0)
    for i in tl.static_range(TOP_K):
        c = tl.where(taken, float("-inf"), choice)
        best = tl.max(c, axis=0)
        best_i = tl.min(tl.where(~taken & (c == best), e, E_BLOCK), axis=0)  # ties: the lower expert id
        # A NaN row matches nothing: take the lowest expert not chosen yet, so every id stays in range.
        best_i = tl.where(best_i == E_BLOCK, tl.min(tl.where(taken, E_BLOCK, e), axis=0), best_i)
        pick = e == best_i
        score = tl.sum(tl.where(pick, scores, 0.0), axis=0)
        top_w = tl.where(k == i, score, top_w)
        top_i = tl.where(k == i, best_i, top_i)
        total += score
        taken = taken | pick
    chosen = k < TOP_K
    if RULE == 1:
        top_w = tl.where(chosen, exp_f32(top_w - tl.max(tl.where(chosen, top_w, float("-inf")), axis=0)), 0.0)
        top_w = tl.div_rn(top_w, tl.sum(top_w, axis=0))
    if RENORMALIZE:
        if RULE == 2:
            total += 1e-20  # DeepSeek-V3's guard
        top_w = tl.div_rn(top_w, total)
    top_w = top_w * scaling
    cols: tl.constexpr = TOP_K + NUM_SHARED
    tl.store(w_ptr + t * cols + k, top_w.to(w_ptr.dtype.element_ty), mask=chosen)
    tl.store(ids_ptr + t * cols + k, top_i.to(ids_ptr.dtype.element_ty), mask=chosen)
    for s in tl.static_range(NUM_SHARED):  # the shared experts: ids E, E + 1, ..., weight 1
        tl.store(w_ptr + t * cols + TOP_K + s, tl.full([], 1.0, tl.float32).to(w_ptr.dtype.element_ty))
        tl.store(ids_ptr + t * cols + TOP_K + s, (n_experts + s).to(ids_ptr.dtype.element_ty))


def router_topk(logits: Tensor, top_k: int, renormalize: bool, rule: int, correction_bias: Tensor | None,
                n_group: int, topk_group: int, scaling: float, weights: Tensor, ids: Tensor) -> None:
    """Write ``weights (T, k + shared)`` and ``ids`` (both contiguous) from ``logits (T, E)`` by rule number ``rule``
    (an index into :data:`bcg.ops.kernels.moe_router.ROUTER_RULES`)."""
    num_rows, num_experts = logits.shape
    e_block = max(2, triton.next_power_of_2(num_experts))
    launch_rows(
        _router_topk_kernel, num_rows, logits, logits.stride(0),
        logits if correction_bias is None else correction_bias,  # unread without a bias
        weights, ids, num_experts, max(1, num_experts // n_group), scaling,
        TOP_K=top_k, NUM_SHARED=weights.shape[1] - top_k, RULE=rule, RENORMALIZE=renormalize,
        HAS_BIAS=correction_bias is not None, N_GROUP=n_group, TOPK_GROUP=topk_group, E_BLOCK=e_block,
        K_BLOCK=max(2, triton.next_power_of_2(top_k)), G_BLOCK=max(2, triton.next_power_of_2(n_group)),
        num_warps=1 if e_block <= 256 else 4,
    )


@triton.jit
def _expert_order_kernel(
    ids_ptr, n_pairs, top_k, n_experts, token_ptr, slot_ptr, end_ptr, expert_ptr,
    CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, HIST_BLOCK: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    chunk_start = tl.program_id(0) * CHUNK
    e = tl.arange(0, E_BLOCK)
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    before = tl.zeros([E_BLOCK], dtype=tl.int32)
    for start in range(0, n_pairs, HIST_BLOCK):
        p = start + tl.arange(0, HIST_BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=0).to(tl.int32)
        ok = (p < n_pairs) & (ids >= 0) & (ids < n_experts)
        total += tl.histogram(ids, E_BLOCK, mask=ok)
        before += tl.histogram(ids, E_BLOCK, mask=ok & (p < chunk_start))
    ends = tl.cumsum(total, axis=0)
    if tl.program_id(0) == 0:
        tl.store(end_ptr + e, ends, mask=e < n_experts)
    first = ends - total + before  # this chunk's first row in each expert's group

    p = chunk_start + tl.arange(0, CHUNK)
    in_chunk = p < n_pairs
    ids = tl.load(ids_ptr + p, mask=in_chunk, other=-1).to(tl.int32)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # rows past the end match no expert
    rank = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert inside the chunk
    slot = tl.sum(onehot * (first[None, :] + rank), axis=1)
    tl.store(slot_ptr + p, slot.to(slot_ptr.dtype.element_ty), mask=in_chunk)
    tl.store(token_ptr + slot, (p // top_k).to(token_ptr.dtype.element_ty), mask=in_chunk)
    tl.store(expert_ptr + slot, ids.to(expert_ptr.dtype.element_ty), mask=in_chunk)


def expert_order(ids: Tensor, num_experts: int, token_index: Tensor, slot: Tensor, group_end: Tensor,
                 expert: Tensor) -> None:
    """Fill the stable expert order of the flattened ``ids (T, k)`` (see :func:`moe_permute.expert_order`)."""
    n_pairs, top_k = ids.numel(), max(1, ids.shape[-1])
    e_block = max(2, triton.next_power_of_2(num_experts))
    chunk = max(16, min(1024, _RANK_ELEMENTS // e_block))
    # At least one program, so that the group ends are written (all zero) for zero tokens.
    grid = (max(1, triton.cdiv(n_pairs, chunk)),)
    _expert_order_kernel[grid](
        ids.reshape(-1), n_pairs, top_k, num_experts, token_index, slot.view(-1), group_end, expert,
        CHUNK=chunk, E_BLOCK=e_block, HIST_BLOCK=max(16, min(4096, _HIST_ELEMENTS)),
        num_warps=4 if chunk * e_block <= 4096 else 8, **launch_options(),
    )


@triton.jit
def _combine_kernel(
    y_ptr, y_stride, slot_ptr, w_ptr, w_stride, out_ptr, out_stride, n_cols, bias_ptr, bias_stride, expert_ptr,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(slot_ptr + t * TOP_K + j).to(tl.int64)
        w = tl.load(w_ptr + t * w_stride + j).to(tl.float32)
        y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the row's expert's output bias, added in fp32 (the module's GEMM epilogue adds it so too)
            e = tl.load(expert_ptr + row).to(tl.int64)
            y += tl.load(bias_ptr + e * bias_stride + cols, mask=mask, other=0.0).to(tl.float32)
        acc += y * w
    tl.store(out_ptr + t * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y_sorted: Tensor, slot: Tensor, weights: Tensor, out: Tensor, bias: Tensor | None = None,
            row_expert: Tensor | None = None) -> None:
    """``out[t] = sum_j weights[t, j] * (y_sorted[slot[t, j]] + bias[row_expert[slot[t, j]]])`` for ``out (T, H)``
    (no bias when ``bias`` is None); ``slot`` contiguous."""
    num_rows, top_k = slot.shape
    n_cols = out.shape[1]
    block = min(1024, max(16, triton.next_power_of_2(n_cols)))
    has_bias = bias is not None
    launch(
        _combine_kernel, (num_rows, triton.cdiv(n_cols, block)),
        y_sorted, y_sorted.stride(0), slot, weights, weights.stride(0), out, out.stride(0), n_cols,
        bias if has_bias else y_sorted, bias.stride(0) if has_bias else 0, row_expert if has_bias else slot,
        TOP_K=top_k, BLOCK=block, HAS_BIAS=has_bias, num_warps=4 if block >= 512 else 1,
    )
