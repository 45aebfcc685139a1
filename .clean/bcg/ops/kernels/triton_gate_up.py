"""Triton kernel behind :func:`bcg.ops.kernels.gate_up.gate_up_silu`: a SwiGLU MLP's fused gate/up projection with
SiLU-and-multiply in its epilogue, so the ``(R, 2I)`` projection is never written and the activation is one launch
fewer.

Each program owns ``block_n`` activation columns: it accumulates the gate and the up rows of the weight for them
side by side over the whole of K (a prefill's hidden size is small enough that no split is needed), rounds both to
the output dtype as the projection's output would be, and writes ``silu(gate) * up`` with
:func:`~bcg.ops.kernels.silu_and_mul`'s two roundings: every activation is computed once. Tile sizes are fixed
functions of the shapes (no autotuning). Importing this module needs Triton.

With ``NORM`` (a constexpr: without it the kernel compiles as it did before) the rows are RMSNorm'ed on the way in,
``rms_norm(x) @ W.T = rstd[m] * sum_k x[m, k] * w_norm[k] * W[n, k]``: the row's ``rstd`` factors out of the dot, so
the kernel sums the squares of the A tiles it loads anyway, multiplies each tile by the norm weight (rounded back to
the operand dtype) before the dot, and scales both accumulators by ``rsqrt(ssq / hidden + eps)`` in fp32 before the
output rounding. No extra pass over ``x``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import dot, grid_dependency, launch, rows_2d


class Tiling(NamedTuple):
    """``block_m x block_n`` activation outputs a program, K in steps of ``block_k``; warps and pipeline depth."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiling(rows: int, inter: int, num_sms: int, *, block_m: int | None = None, block_n: int = 32,
           block_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> Tiling:
    """The tiles for ``rows`` rows and ``inter`` activation columns: narrow column blocks (32: the weight read needs
    every SM, and a llama MLP has only 44-256 blocks of 32), a 16-row tile for up to 16 rows and Hopper's 64-row wgmma
    tile above, long K steps (128) while the A tile stays small. The H200's sweep (``benchmarks/mlp_kernels.py --sweep
    gate_up``, round 8) found this the fastest or within 0.5% of it for the llama-dense and Llama-3.2-1B MLPs at 16 and
    64 rows. Every choice can be overridden.

    Example::

        >>> tiling(64, 2816, 132)
        Tiling(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=3)
    """
    block_m = block_m or (16 if rows <= 16 else 64 if rows <= 64 else 128)
    block_k = block_k or (128 if block_m <= 64 else 64)
    return Tiling(block_m, block_n, block_k, num_warps, num_stages)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, x_stride, w_ptr, w_up_ptr, w_stride, out_ptr, out_stride, norm_ptr, eps, n_rows, inter, hidden,
    NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < inter
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    gate_cols = w_ptr + cols.to(tl.int64)[None, :] * w_stride  # weight rows 0..I-1 are the gate's
    up_cols = w_up_ptr + cols.to(tl.int64)[None, :] * w_stride  # rows I..2I-1 the up's
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: the rows' sums of squares (unused, and dropped, without it)
    for i in range(K_ITERS):  # a constexpr trip count: no loop bound read at run time
        ks = i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:  # the squares of the rows as loaded; the dot takes x * w_norm rounded to the operand dtype
            af = a.to(tl.float32)
            ssq += tl.sum(af * af, axis=1)
            w_norm = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (af * w_norm[None, :]).to(x_ptr.dtype.element_ty)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_cols + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + ks[:, None], mask=w_mask, other=0.0)
        acc_gate = dot(a, w_gate, acc_gate)
        acc_up = dot(a, w_up, acc_up)
    if NORM:  # the row's rstd, factored out of the dot, in fp32 before the projection's rounding
        rstd = tl.rsqrt(ssq / hidden + eps)
        acc_gate = acc_gate * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    # The projection's output rounding, then silu_and_mul's arithmetic and roundings (triton_activation).
    gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out_offsets = rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_offsets, (silu * up).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gate_up_silu(x: Tensor, weight: Tensor, out: Tensor, plan: Tiling, norm_weight: Tensor | None = None,
                 eps: float = 1e-6) -> Any:
    """``out[:] = silu_and_mul(x @ weight.T)`` for ``x (R, H)``, ``weight (2I, H)`` (gate rows, then up rows),
    ``out (R, I)``, on the tiles of ``plan`` (:func:`tiling`); with ``norm_weight (H,)`` (contiguous) the rows are
    ``rms_norm(x, norm_weight, eps)`` first, folded into the projection. Returns Triton's compiled kernel (for
    benchmarks)."""
    x2, out2 = rows_2d(x), rows_2d(out, write=True)
    n_rows, inter, hidden = x2.shape[0], weight.shape[0] // 2, weight.shape[1]
    grid = (triton.cdiv(inter, plan.block_n), triton.cdiv(n_rows, plan.block_m))
    norm = norm_weight is not None
    return launch(
        _gate_up_silu_kernel, grid,
        x2, x2.stride(0), weight, weight[inter:], weight.stride(0), out2, out2.stride(0),
        norm_weight if norm else x2, float(eps), n_rows, inter, hidden,  # without the norm a pointer never read
        NORM=norm, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        K_ITERS=triton.cdiv(hidden, plan.block_k),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
