"""Triton kernels behind :mod:`bcg.ops.kernels.norm`: one program per row, the whole row in registers.

Launchers take any tensors with a contiguous last dimension (rows may be strided) and write given outputs, so
they run unchanged under Triton's interpreter on CPU tensors (the CPU tests) and inside a CUDA graph capture (no
allocation, no host read). Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import grid_dependency, launch_rows, row_block, row_warps, rows_2d


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, res_out_ptr, res_out_stride,
    n_cols, eps, part_stride,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NUM_PARTS: tl.constexpr = 1,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    # A split-K GEMM's fp32 partials (bcg.ops.kernels.down_partials): the rest summed in order as they are read.
    for p in tl.static_range(1, NUM_PARTS):
        x += tl.load(x_ptr + p * part_stride + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # Rounded to the residual's dtype before the norm reads it, as `h = h + x` followed by `norm(h)` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    """``out[:] = rms_norm(x) * weight`` over the last dimension."""
    x2, out2 = rows_2d(x), rows_2d(out, write=True)
    n_rows, n_cols = x2.shape
    block = row_block(n_cols)
    launch_rows(
        _rms_norm_kernel, n_rows,
        x2, x2.stride(0), x2, x2.stride(0), weight, out2, out2.stride(0), out2, out2.stride(0), n_cols, eps, 0,
        HAS_RESIDUAL=False, BLOCK=block, num_warps=row_warps(block),
    )


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor, residual_out: Tensor) -> None:
    """``residual_out[:] = x + residual``; ``out[:] = rms_norm(residual_out) * weight``. Each row is read whole
    before it is written, so ``out`` may be ``x`` and ``residual_out`` may be ``residual`` (in place). ``x`` may be
    a split-K GEMM's partials instead, ``(S, *residual.shape)`` in fp32: summed in order, then added."""
    num_parts, part_stride = 1, 0
    if x.dim() == residual.dim() + 1:
        num_parts, part_stride, x = x.shape[0], x.stride(0), x[0]
    x2, r2 = rows_2d(x), rows_2d(residual, write=residual_out is residual)
    out2, ro2 = rows_2d(out, write=True), rows_2d(residual_out, write=True)
    n_rows, n_cols = x2.shape
    block = row_block(n_cols)
    launch_rows(
        _rms_norm_kernel, n_rows,
        x2, x2.stride(0), r2, r2.stride(0), weight, out2, out2.stride(0), ro2, ro2.stride(0), n_cols, eps,
        part_stride, HAS_RESIDUAL=True, BLOCK=block, NUM_PARTS=num_parts, num_warps=row_warps(block),
    )
