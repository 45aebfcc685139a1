"""A SwiGLU MLP's fused gate/up projection and its activation, ``silu_and_mul(x @ weight.T)``: one kernel at short
prompts, optionally with the RMSNorm before it folded in.

The projection's ``(R, 2I)`` output exists only to be read once by SiLU-and-multiply. Up to :data:`MAX_FUSED_ROWS`
rows of bf16/fp16 on CUDA, :func:`gate_up_silu` is one Triton kernel (:mod:`bcg.ops.kernels.triton_gate_up`) that
accumulates the gate and up columns side by side and applies the activation in its epilogue, each element once and
with the two steps' roundings; otherwise (larger batches, fp32, other devices, a ``torch.compile`` trace) it is the
two steps, ``F.linear`` then :func:`~bcg.ops.kernels.silu_and_mul`. The one kernel differs from them only in the
matmul's summation order. Which of this, the two steps and :func:`~bcg.ops.kernels.swiglu_down` a model's MLP runs
is ``BCG_MLP_FUSION`` (:mod:`bcg.env`).

With ``norm_weight`` it is ``silu_and_mul(rms_norm(x, norm_weight, eps) @ weight.T)`` (``BCG_NORM_FUSION``: the
post-attention norm of a decoder layer, whose kernel then disappears). The steps are bcg's
:func:`~bcg.ops.kernels.rms_norm` first; the one kernel folds the norm in, ``rstd[m] * sum_k (x * w_norm)[m, k] *
W[n, k]``, and so rounds differently: the steps round the normed rows ``x * rstd * w_norm`` to the operand dtype
before the matmul, the kernel rounds ``x * w_norm`` instead and applies ``rstd`` to the fp32 sums. Both are one
rounding of the operand, so the two differ at the level of bf16 rounding, not in kind. On the H200 the variant ran
2.2x as long as the plain kernel in whole forwards (15.2 against 6.9 µs a layer on llama-dense at 64 tokens): the A
tile, also read by the norm's arithmetic, is no longer streamed into shared memory ahead of the dot. Models use it
only under ``BCG_NORM_FUSION=on``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.ops.kernels.activation import silu_and_mul
from bcg.ops.kernels.dispatch import kernel_path, num_sms
from bcg.ops.kernels.norm import rms_norm

__all__ = ["MAX_FUSED_ROWS", "gate_up_silu", "is_fused"]

# Rows up to which the one kernel runs: on the H200 a whole MLP took 0.91-0.97x the two steps' time at 16-64 rows and
# 1.10-1.15x at 128, where cuBLAS's GEMM is nearer its compute bound (benchmarks/mlp_kernels.py, round 8).
MAX_FUSED_ROWS = 64
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def is_fused(x: Tensor, weight: Tensor, norm_weight: Tensor | None = None) -> bool:
    """Whether :func:`gate_up_silu` runs its one kernel for these operands (given the fused path on CUDA): the same
    rule with or without a norm to fold, whose weight (any float dtype) the kernel reads as a contiguous vector."""
    rows = x.numel() // max(1, x.shape[-1])
    return (0 < rows <= MAX_FUSED_ROWS and x.dtype in _FUSED_DTYPES and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.is_contiguous() and (norm_weight is None or norm_weight.is_contiguous()))


def gate_up_silu(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
                 impl: str = "fused") -> Tensor:
    """``silu(gate) * up`` of ``x @ weight.T``, ``weight (2I, H)`` holding the gate rows then the up rows:
    ``(..., H) -> (..., I)``. With ``norm_weight (H,)`` the rows are ``rms_norm(x, norm_weight, eps)`` first (folded
    into the one kernel; see the module docstring for its rounding). ``impl`` picks the kernels
    (:mod:`bcg.ops.kernels.dispatch`).

    Example:
        >>> x, w, n = torch.randn(3, 4), torch.randn(10, 4), torch.rand(4)
        >>> gate, up = (x @ w.T).chunk(2, dim=-1)
        >>> torch.allclose(gate_up_silu(x, w), F.silu(gate) * up)
        True
        >>> gate, up = (F.rms_norm(x, (4,), n, 1e-6) @ w.T).chunk(2, dim=-1)
        >>> torch.allclose(gate_up_silu(x, w, norm_weight=n), F.silu(gate) * up)
        True
    """
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"gate_up_silu needs x (..., H) and a weight (2I, H) of gate then up rows; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if norm_weight is not None and norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"gate_up_silu's norm_weight must be (H,) = ({x.shape[-1]},), the RMSNorm's scale of x's "
                         f"rows; got {tuple(norm_weight.shape)}")
    if kernel_path(impl, x) != "triton" or not is_fused(x, weight, norm_weight):
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps, impl=impl)
        return silu_and_mul(F.linear(x, weight), impl=impl)
    from bcg.ops.kernels import triton_gate_up

    inter = weight.shape[0] // 2
    rows = x.numel() // x.shape[-1]
    out = x.new_empty((*x.shape[:-1], inter))
    triton_gate_up.gate_up_silu(x, weight, out, triton_gate_up.tiling(rows, inter, num_sms(x.device)),
                                norm_weight, eps)
    return out
