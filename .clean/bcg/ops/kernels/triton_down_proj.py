"""Triton kernel behind :mod:`bcg.ops.kernels.down_proj`: an MLP's down projection with SiLU-and-multiply in its
prologue and its split-K partials summed by the last program of each output tile.

At prefill's short prompts the down projection reads a large weight for a few rows: cuBLAS splits K and adds a
reduce kernel, and SiLU-and-multiply is a kernel of its own before it. Here one launch does all three: every program
loads its rows' gate and up columns, computes ``silu(gate) * up`` with eager torch's two roundings, multiplies by its
slice of the weight, and (split K) writes fp32 partials; the program that finishes a tile last (an atomic counter
per tile) sums the partials in split order, so the result does not depend on which program ran first, writes the
tile and resets its counter to zero for the next launch. Tile sizes are fixed functions of the shapes (no autotuning:
a tuner syncs the host and cannot run in a capture). Importing this module needs Triton.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import dot, grid_dependency, k_split, launch, rows_2d


class Tiling(NamedTuple):
    """One launch's tiles: ``block_m x block_n`` outputs a program, K in steps of ``block_k``, ``split_k`` programs
    a tile each covering ``k_iters`` steps; ``tiles`` output tiles in all; the program's warps and the depth of its
    load pipeline."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_iters: int
    tiles: int
    num_warps: int
    num_stages: int


def tiling(rows: int, cols: int, inner: int, num_sms: int, *, block_m: int | None = None, block_n: int = 64,
           block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
           num_stages: int = 4, programs_per_sm: int = 2, min_k_iters: int = 4) -> Tiling:
    """The tiles for ``(rows, inner) @ (inner, cols)``: K split until about ``programs_per_sm`` programs run per SM
    (the weight read is what takes the time at few rows, and it needs every SM), each split at least
    ``min_k_iters`` K steps long. 64 rows or more run on Hopper's wgmma; 128-row tiles take 8 warps and narrow ones
    longer K steps, which keeps every configuration under the register file with a four-deep cp.async pipeline
    (tests/ops/kernels/test_kernel_aot.py compiles them for sm_90 and checks that nothing spills). Every choice can
    be overridden (``benchmarks/mlp_kernels.py --sweep down`` times the alternatives).

    Example::

        >>> tiling(64, 1024, 2816, 132)
        Tiling(block_m=64, block_n=64, block_k=64, split_k=11, k_iters=4, tiles=16, num_warps=4, num_stages=4)
    """
    block_m = block_m or min(128, max(16, triton.next_power_of_2(rows)))
    block_k = block_k or (128 if block_m <= 32 else 64)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n)
    split, k_iters = k_split(tiles, triton.cdiv(inner, block_k), num_sms, split_k, programs_per_sm, min_k_iters)
    return Tiling(block_m, block_n, block_k, split, k_iters, tiles,
                  num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages)


@triton.jit
def _swiglu_down_kernel(
    x_ptr, x_stride, w_ptr, w_stride, out_ptr, out_stride, part_ptr, count_ptr,
    n_rows, n_cols, inner,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr, SWIGLU: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_ITERS):  # a constexpr trip count: no loop bound read at run time
        ks = (pid_k * K_ITERS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inner
        a_mask = row_ok[:, None] & k_ok[None, :]
        if SWIGLU:
            gate = tl.load(x_rows + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + inner + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
            # silu_and_mul's arithmetic and roundings (bcg.ops.kernels.triton_activation), then the matmul's dtype.
            silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            a = (silu * up).to(w_ptr.dtype.element_ty)
        else:  # a plain split-K matmul of x (R, I): what the benchmark compares the prologue's cost against
            a = tl.load(x_rows + ks[None, :], mask=a_mask, other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot(a, w, acc)
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_offsets = rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile_size = n_rows * n_cols
        part_offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        tl.store(part_ptr + pid_k * tile_size + part_offsets, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter releases it to the last program
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # split order, whoever finished first: the same bits every run
                # .cg: from L2, where the other programs' stores are; this SM's L1 may hold nothing of them
                total += tl.load(part_ptr + s * tile_size + part_offsets, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def swiglu_down(x: Tensor, weight: Tensor, out: Tensor, partials: Tensor, counters: Tensor, plan: Tiling,
                swiglu: bool = True) -> Any:
    """``out[:] = silu_and_mul(x) @ weight.T`` for ``x (R, 2I)``, ``weight (H, I)``, ``out (R, H)``, on the tiles of
    ``plan`` (:func:`tiling`). ``partials`` holds ``plan.split_k * R * H`` fp32 values (unused at one split) and
    ``counters`` at least ``plan.tiles`` int32 zeros, which the kernel leaves zero. ``swiglu=False``: ``x (R, I)``
    is the matmul's operand as it is. Returns Triton's compiled kernel (its registers and spills, for benchmarks)."""
    x2, out2 = rows_2d(x), rows_2d(out, write=True)
    n_rows, n_cols, inner = x2.shape[0], weight.shape[0], weight.shape[1]
    grid = (triton.cdiv(n_cols, plan.block_n), triton.cdiv(n_rows, plan.block_m), plan.split_k)
    return launch(
        _swiglu_down_kernel, grid,
        x2, x2.stride(0), weight, weight.stride(0), out2, out2.stride(0), partials, counters, n_rows, n_cols, inner,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT_K=plan.split_k,
        K_ITERS=plan.k_iters, SWIGLU=swiglu, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
