"""Triton kernel behind :mod:`bcg.ops.kernels.activation`: SiLU-and-multiply, one program per (row, column block).

Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import exp_f32, launch

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) with an accurate exp and an IEEE division, rounded to the input dtype
    # before the multiply (eager torch rounds there too).
    silu = tl.div_rn(gate, 1.0 + exp_f32(-gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor, out: Tensor) -> None:
    """``out[:] = silu(x[..., :I]) * x[..., I:]``; ``out`` is ``(..., I)``."""
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.view(-1, n_cols)  # raises rather than writing into a copy
    block = min(_MAX_BLOCK, max(16, triton.next_power_of_2(n_cols)))
    launch(
        _silu_and_mul_kernel, (x2.shape[0], triton.cdiv(n_cols, block)),
        x2, x2.stride(0), out2, out2.stride(0), n_cols, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
