"""Triton kernel behind :func:`bcg.ops.kernels.qkv_rope.qkv_proj_rope`: the attention's fused q/k/v projection with
the q/k norm, RoPE, the split into the island's inputs and the K/V write in its epilogue.

RoPE pairs column ``j`` of a head with column ``j + D/2``, so each program owns ``half_n`` such pairs of one head: it
accumulates the two column blocks side by side, rounds them to the projection's dtype as its output would be, and
then does what :mod:`bcg.ops.kernels.triton_rope` does to that output (per-head RMSNorm, which needs the whole head in
one program: ``half_n = D/2`` then; the rotation in fp32 with its roundings; the stores into q, k, v and the KV
pool). The ``(T, (H + 2 KV) D)`` projection is never written and the RoPE kernel is not launched.

A projection's few dozen column tiles cannot pull its weight from HBM at full bandwidth, so K is split as the down
projection's kernel splits it (:mod:`bcg.ops.kernels.triton_down_proj`): every program writes fp32 partials, and the
last of a tile's programs (an atomic counter per tile) sums them in split order, resets the counter, and runs the
epilogue. Tile sizes are fixed functions of the shapes (no autotuning). Importing this module needs Triton.

With ``NORM`` the kernel also runs the decoder layer's input add + RMSNorm in its prologue
(:mod:`bcg.ops.kernels.triton_qkv_prologue`); without it the prologue compiles away.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_qkv_prologue import norm_a_tile, scale_by_rstd, store_ssq, sum_ssq
from bcg.ops.kernels.triton_utils import cos_f32, dot, grid_dependency, k_split, launch, sin_f32

__all__ = ["Tiling", "partials_size", "qkv_rope", "tiling"]


class Tiling(NamedTuple):
    """``block_m`` rows by ``half_n`` RoPE pairs (``2 * half_n`` columns of one head) a program, K in steps of
    ``block_k``, ``split_k`` programs a tile each covering ``k_iters`` steps; ``tiles`` output tiles in all; warps and
    pipeline depth."""

    block_m: int
    half_n: int
    block_k: int
    split_k: int
    k_iters: int
    tiles: int
    num_warps: int
    num_stages: int


def tiling(rows: int, hidden: int, heads: int, head_dim: int, has_norm: bool, num_sms: int, *,
           block_m: int | None = None, half_n: int | None = None, block_k: int = 64, split_k: int | None = None,
           num_warps: int | None = None, num_stages: int = 4, programs_per_sm: int = 2,
           min_k_iters: int = 4) -> Tiling:
    """The tiles for ``rows`` rows by ``heads`` heads (q, k and v together) of ``head_dim``, over ``hidden``: 16
    pairs a program (narrow column blocks spread the weight read over the SMs, as the gate/up kernel's do), the whole
    half head under a per-head norm; a 16-row tile up to 16 rows and Hopper's 64-row wgmma tile above; K split until
    about ``programs_per_sm`` programs run per SM, each split at least ``min_k_iters`` K steps long; 8 warps for a
    64 x 64 pair tile, whose two accumulators and angles spill from 4 warps' registers
    (tests/ops/kernels/test_kernel_aot.py compiles the tiles for sm_90 and checks). Every choice can be overridden
    (``benchmarks/qkv_kernels.py --sweep`` times the alternatives).

    Example::

        >>> tiling(64, 2048, 48, 64, False, 132)
        Tiling(block_m=64, half_n=16, block_k=64, split_k=3, k_iters=11, tiles=96, num_warps=4, num_stages=4)
    """
    half = head_dim // 2
    block_m = block_m or (16 if rows <= 16 else 64)
    half_n = half if has_norm else (half_n or min(16, half))
    tiles = triton.cdiv(rows, block_m) * heads * (half // half_n)
    split, k_iters = k_split(tiles, triton.cdiv(hidden, block_k), num_sms, split_k, programs_per_sm, min_k_iters)
    return Tiling(block_m, half_n, block_k, split, k_iters, tiles,
                  num_warps or (8 if block_m * half_n >= 64 * 64 else 4), num_stages)


def partials_size(plan: Tiling, rows: int, width: int, norm: bool = False) -> int:
    """The fp32 values the launcher's ``partials`` must hold for ``rows`` rows of a ``width``-column projection on
    ``plan``'s tiles: the split accumulators, and with the prologue (``norm``) the split sums of squares after them,
    one slot per split and column block (at least 1: one split reads no partials)."""
    if plan.split_k == 1:
        return 1
    column_blocks = plan.tiles // triton.cdiv(rows, plan.block_m)
    return plan.split_k * rows * width + (plan.split_k * column_blocks * rows if norm else 0)


@triton.jit
def _qkv_rope_kernel(
    x_ptr, x_stride, w_ptr, w_stride, bias_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps,
    q_ptr, q_stride0, q_stride1, k_ptr, k_stride0, k_stride1, v_ptr, v_stride0, v_stride1,
    slot_ptr, kc_ptr, kc_stride0, kc_stride1, vc_ptr, vc_stride0, vc_stride1, part_ptr, count_ptr,
    n_rows, hidden, res_ptr, res_stride, res_out_ptr, res_out_stride, nw_ptr, norm_eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HALF_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_CACHE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_ITERS: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
):
    # NORM: the layer's input RMSNorm in the prologue, ADD: the residual add before it (triton_qkv_prologue); off,
    # the prologue's pointers are x's stand-ins, never read. HAS_NORM is the epilogue's per-head q/k norm.
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    HALF: tl.constexpr = DIM // 2
    BLOCKS_PER_HEAD: tl.constexpr = HALF // HALF_N
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    head = pid_n // BLOCKS_PER_HEAD
    j = (pid_n % BLOCKS_PER_HEAD) * HALF_N + tl.arange(0, HALF_N)  # pair index within the half head
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    col1 = head * DIM + j  # the weight's rows (the projection's columns) of the pairs' first and second halves
    col2 = col1 + HALF
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w1 = w_ptr + col1.to(tl.int64)[None, :] * w_stride
    w2 = w_ptr + col2.to(tl.int64)[None, :] * w_stride
    acc1 = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    if NORM:  # the rows' sums of squares over this program's K range (without NORM never defined: no register)
        ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in range(K_ITERS):  # a constexpr trip count: no loop bound read at run time
        ks = (pid_k * K_ITERS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            a, ssq = norm_a_tile(a, ssq, rows, row_ok, ks, k_ok, pid_n, res_ptr, res_stride, res_out_ptr,
                                 res_out_stride, nw_ptr, ADD)
        acc1 = dot(a, tl.load(w1 + ks[:, None], mask=k_ok[:, None], other=0.0), acc1)
        acc2 = dot(a, tl.load(w2 + ks[:, None], mask=k_ok[:, None], other=0.0), acc2)
    if SPLIT_K == 1:
        if NORM:
            acc1, acc2 = scale_by_rstd(acc1, acc2, ssq, hidden, norm_eps)
        _epilogue(acc1, acc2, rows, j, head, x_ptr, bias_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps,
                  q_ptr, q_stride0, q_stride1, k_ptr, k_stride0, k_stride1, v_ptr, v_stride0, v_stride1,
                  slot_ptr, kc_ptr, kc_stride0, kc_stride1, vc_ptr, vc_stride0, vc_stride1, n_rows,
                  HEADS, KV_HEADS, DIM, HAS_BIAS, HAS_NORM, HAS_CACHE)
    else:
        width = (HEADS + 2 * KV_HEADS) * DIM
        tile_size = n_rows * width
        part = part_ptr + rows.to(tl.int64)[:, None] * width + col1[None, :]
        p_mask = (rows < n_rows)[:, None]
        tl.store(part + pid_k * tile_size, acc1, mask=p_mask)
        tl.store(part + pid_k * tile_size + HALF, acc2, mask=p_mask)
        if NORM:  # after the SPLIT_K accumulator partials (the launcher sizes the buffer for both)
            store_ssq(part_ptr + SPLIT_K * tile_size, ssq, rows, row_ok, pid_n, pid_k, n_rows)
        tl.debug_barrier()  # every thread's partials are written before the counter releases them
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc1 = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # split order, whoever finished first: the same bits every run
                # .cg: from L2, where the other programs' stores are; this SM's L1 may hold nothing of them
                acc1 += tl.load(part + s * tile_size, mask=p_mask, other=0.0, cache_modifier=".cg")
                acc2 += tl.load(part + s * tile_size + HALF, mask=p_mask, other=0.0, cache_modifier=".cg")
            if NORM:
                ssq = sum_ssq(part_ptr + SPLIT_K * tile_size, rows, row_ok, pid_n, n_rows, SPLIT_K, BLOCK_M)
                acc1, acc2 = scale_by_rstd(acc1, acc2, ssq, hidden, norm_eps)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            _epilogue(acc1, acc2, rows, j, head, x_ptr, bias_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps,
                      q_ptr, q_stride0, q_stride1, k_ptr, k_stride0, k_stride1, v_ptr, v_stride0, v_stride1,
                      slot_ptr, kc_ptr, kc_stride0, kc_stride1, vc_ptr, vc_stride0, vc_stride1, n_rows,
                      HEADS, KV_HEADS, DIM, HAS_BIAS, HAS_NORM, HAS_CACHE)


@triton.jit
def _epilogue(acc1, acc2, rows, j, head, x_ptr, bias_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps,
              q_ptr, q_stride0, q_stride1, k_ptr, k_stride0, k_stride1, v_ptr, v_stride0, v_stride1,
              slot_ptr, kc_ptr, kc_stride0, kc_stride1, vc_ptr, vc_stride0, vc_stride1, n_rows,
              HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_NORM: tl.constexpr, HAS_CACHE: tl.constexpr):
    """The projection's whole sums of one tile (``acc1``: the pairs' first halves, ``acc2``: their second) to q, k
    or v and the KV pool: bias, the output's rounding, then ``triton_rope``'s arithmetic."""
    HALF: tl.constexpr = DIM // 2
    row_ok = rows < n_rows
    col1 = head * DIM + j
    col2 = col1 + HALF
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + col1).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + col2).to(tl.float32)[None, :]
    # The projection's output as F.linear rounds it; from here on, triton_rope's arithmetic on that output.
    x1 = acc1.to(x_ptr.dtype.element_ty)
    x2 = acc2.to(x_ptr.dtype.element_ty)
    mask = row_ok[:, None] & (j < HALF)[None, :]
    t = rows.to(tl.int64)[:, None]
    if HAS_CACHE:
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)[:, None]
    if head >= HEADS + KV_HEADS:  # a v head: copied as it is
        hv = head - HEADS - KV_HEADS
        v_dst = v_ptr + t * v_stride0 + hv * v_stride1 + j[None, :]
        tl.store(v_dst, x1.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + HALF, x2.to(v_ptr.dtype.element_ty), mask=mask)
        if HAS_CACHE:
            vc_dst = vc_ptr + slot * vc_stride0 + hv * vc_stride1 + j[None, :]
            tl.store(vc_dst, x1.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_dst + HALF, x2.to(vc_ptr.dtype.element_ty), mask=mask)
    else:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        if HAS_NORM:  # HALF_N == HALF: the program holds the whole head
            rstd = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / DIM + eps)[:, None]
            norm_ptr = qw_ptr if head < HEADS else kw_ptr
            nw1 = tl.load(norm_ptr + j).to(tl.float32)[None, :]
            nw2 = tl.load(norm_ptr + HALF + j).to(tl.float32)[None, :]
            # Rounded to the input dtype, as the norm's output is before the rotation reads it.
            x1f = (x1f * rstd * nw1).to(x_ptr.dtype.element_ty).to(tl.float32)
            x2f = (x2f * rstd * nw2).to(x_ptr.dtype.element_ty).to(tl.float32)
        # Angles in fp32 exactly as the reference: float(position) * inv_freq, one rounding.
        angle = (tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
                 * tl.load(inv_freq_ptr + j).to(tl.float32)[None, :])
        cos = cos_f32(angle)
        sin = sin_f32(angle)
        # rotate_half(x) = (-x2, x1): products and sums rounded one by one (the launch turns off FMA contraction).
        o1 = x1f * cos - x2f * sin
        o2 = x2f * cos + x1f * sin
        if head < HEADS:
            q_dst = q_ptr + t * q_stride0 + head * q_stride1 + j[None, :]
            tl.store(q_dst, o1.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(q_dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            hk = head - HEADS
            k1, k2 = o1.to(k_ptr.dtype.element_ty), o2.to(k_ptr.dtype.element_ty)
            k_dst = k_ptr + t * k_stride0 + hk * k_stride1 + j[None, :]
            tl.store(k_dst, k1, mask=mask)
            tl.store(k_dst + HALF, k2, mask=mask)
            if HAS_CACHE:  # the same k as rounded above, at the token's KV-pool slot
                kc_dst = kc_ptr + slot * kc_stride0 + hk * kc_stride1 + j[None, :]
                tl.store(kc_dst, k1.to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(kc_dst + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mask)


def qkv_rope(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], positions: Tensor, inv_freq: Tensor,
    q_weight: Optional[Tensor], k_weight: Optional[Tensor], eps: float, q_out: Tensor, k_out: Tensor, v_out: Tensor,
    cache: Optional[tuple[Tensor, Tensor, Tensor]], partials: Tensor, counters: Tensor, plan: Tiling, *,
    norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-6, residual: Optional[Tensor] = None,
    residual_out: Optional[Tensor] = None,
) -> Any:
    """Write ``q_out (T, H, D)``, ``k_out``, ``v_out (T, KV, D)`` from ``x (T, hidden) @ weight.T (+ bias)`` with
    ``weight ((H + 2 KV) D, hidden)``, and with ``cache=(k_cache, v_cache, slots)`` k and v at row ``slots[t]`` of
    the caches, on the tiles of ``plan`` (:func:`tiling`). ``partials`` holds :func:`partials_size` fp32 values and
    ``counters`` at least ``plan.tiles`` int32 zeros, which the kernel leaves zero. With ``norm_weight (hidden,)``
    the projection's input is ``rms_norm(x, norm_weight, norm_eps)``, and with ``residual (T, hidden)`` too it is
    ``rms_norm(x + residual)``, the sum written to ``residual_out`` (a buffer of its own: other programs are still
    reading ``x`` and ``residual``). Returns Triton's compiled kernel (for benchmarks)."""
    n_rows, hidden = x.shape
    heads, dim = q_out.shape[1], q_out.shape[2]
    kv_heads = k_out.shape[1]
    has_norm = q_weight is not None and k_weight is not None
    k_cache, v_cache, slots = cache if cache is not None else (k_out, v_out, positions)  # unread without a cache
    grid = ((heads + 2 * kv_heads) * (dim // 2 // plan.half_n), triton.cdiv(n_rows, plan.block_m), plan.split_k)
    args = (
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else inv_freq, positions, inv_freq,
        q_weight if has_norm else inv_freq, k_weight if has_norm else inv_freq, eps,  # unread without norms
        q_out, q_out.stride(0), q_out.stride(1), k_out, k_out.stride(0), k_out.stride(1),
        v_out, v_out.stride(0), v_out.stride(1),
        slots, k_cache, k_cache.stride(0), k_cache.stride(1), v_cache, v_cache.stride(0), v_cache.stride(1),
        partials, counters, n_rows, hidden,
    )
    norm, add = norm_weight is not None, residual is not None
    if add and (residual_out is None or residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr())):
        raise ValueError("qkv_rope: the residual add needs a residual_out of its own, not x or residual")
    res, res_out = (residual, residual_out) if add else (x, x)  # unread without the add
    return launch(
        _qkv_rope_kernel, grid, *args, res, res.stride(0), res_out, res_out.stride(0),
        norm_weight if norm else x, float(norm_eps),  # unread without the norm
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HALF_N=plan.half_n, HAS_BIAS=bias is not None, HAS_NORM=has_norm,
        HAS_CACHE=cache is not None, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, SPLIT_K=plan.split_k,
        K_ITERS=plan.k_iters, NORM=norm, ADD=add, num_warps=plan.num_warps, num_stages=plan.num_stages,
        enable_fp_fusion=False,
    )
