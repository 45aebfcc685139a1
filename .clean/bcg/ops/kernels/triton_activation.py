"""Triton kernels behind :mod:`bcg.ops.kernels.activation`: SiLU-and-multiply and gpt-oss's clamped SwiGLU, one
program per (row, column block).

Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import exp_f32, grid_dependency, launch, rows_2d

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, n_cols, BLOCK: tl.constexpr):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # silu = x / (1 + exp(-x)), rounded to the input dtype before the multiply as eager torch rounds there too.
    # The fast exp and division are 1.5x quicker than libdevice's exp and an IEEE division (this kernel is ALU
    # bound) and, measured on an H200, still bit-identical to torch in bf16 after that rounding.
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor, out: Tensor) -> None:
    """``out[:] = silu(x[..., :I]) * x[..., I:]``; ``out`` is ``(..., I)``."""
    n_cols = x.shape[-1] // 2
    x2, out2 = rows_2d(x), rows_2d(out, write=True)
    block = min(_MAX_BLOCK, max(16, triton.next_power_of_2(n_cols)))
    launch(
        _silu_and_mul_kernel, (x2.shape[0], triton.cdiv(n_cols, block)),
        x2, x2.stride(0), out2, out2.stride(0), n_cols, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )


@triton.jit
def _clamped_swiglu_kernel(x_ptr, x_stride, bias_ptr, bias_stride, expert_ptr, out_ptr, out_stride, n_cols, alpha,
                           limit, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + 2 * cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + 2 * cols + 1, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # the expert's bias, added and rounded as the module's `x @ W + b` rounds
        b = bias_ptr + tl.load(expert_ptr + row).to(tl.int64) * bias_stride + 2 * cols
        gate = (gate + tl.load(b, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        up = (up + tl.load(b + 1, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    gate = tl.minimum(gate, limit)  # clamps are exact
    up = tl.minimum(tl.maximum(up, -limit), limit)
    # Each op rounds to the input dtype where the module's torch ops round: gate * alpha, sigmoid, the products, + 1.
    scaled = (gate * alpha).to(dt).to(tl.float32)
    sig = tl.div_rn(1.0, 1.0 + exp_f32(-scaled)).to(dt).to(tl.float32)
    glu = (gate * sig).to(dt).to(tl.float32)
    up1 = (up + 1.0).to(dt).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (up1 * glu).to(dt), mask=mask)


def clamped_swiglu(x: Tensor, bias: Tensor | None, expert: Tensor, alpha: float, limit: float, out: Tensor) -> None:
    """``out (R, I)`` from interleaved gate/up rows ``x (R, 2I)`` and each row's expert bias (or None)."""
    n_cols = x.shape[-1] // 2
    block = min(_MAX_BLOCK, max(16, triton.next_power_of_2(n_cols)))
    launch(
        _clamped_swiglu_kernel, (x.shape[0], triton.cdiv(n_cols, block)),
        x, x.stride(0), x if bias is None else bias, 0 if bias is None else bias.stride(0), expert,  # unread: no bias
        out, out.stride(0), n_cols, alpha, limit, HAS_BIAS=bias is not None, BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
