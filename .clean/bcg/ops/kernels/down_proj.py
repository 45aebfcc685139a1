"""A SwiGLU MLP's activation and down projection, ``silu_and_mul(gate_up) @ weight.T``: one kernel at short prompts.

At a few dozen rows the down projection reads its whole weight for little work: cuBLAS splits K and adds a reduce
kernel, and SiLU-and-multiply runs as a kernel of its own before it, so the step is three launches. Up to
:data:`MAX_FUSED_ROWS` rows of bf16/fp16 on CUDA, :func:`swiglu_down` is one Triton kernel
(:mod:`bcg.ops.kernels.triton_down_proj`): the activation computed as the A operand is loaded (with
:func:`~bcg.ops.kernels.silu_and_mul`'s roundings) and K split over the SMs, the partials summed in a fixed order by
the tile's last program. Otherwise (larger batches, where cuBLAS needs no split; fp32; other devices; a
``torch.compile`` trace, which sees the same ops as before) it is the two steps: :func:`~bcg.ops.kernels.silu_and_mul`,
then ``F.linear``. The one kernel differs from them only in the matmul's summation order.

On the H200 the one kernel ran 1.4-2.8x slower than the three launches (``benchmarks/mlp_kernels.py``): every
output-column tile recomputes the activation of the rows it reads (``cols / block_n`` times in all, where the
separate kernel does it once). Models call it only with ``BCG_MLP_FUSION=down`` (:mod:`bcg.env`).
"""


from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.ops.kernels.activation import silu_and_mul
from bcg.ops.kernels.dispatch import kernel_path, num_sms
from bcg.ops.kernels.tile_counters import tile_counters

__all__ = ["MAX_FUSED_ROWS", "swiglu_down", "swiglu_down_reference"]

# Rows up to which the fused kernel runs (benchmarks/mlp_kernels.py measures both paths per row count).
MAX_FUSED_ROWS = 128
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def swiglu_down_reference(gate_up: Tensor, weight: Tensor) -> Tensor:
    """Plain torch: ``silu(gate) * up`` with ``gate, up = gate_up.chunk(2, -1)``, then ``F.linear`` by ``weight``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


def is_fused(gate_up: Tensor, weight: Tensor) -> bool:
    """Whether :func:`swiglu_down` runs its one kernel for these operands (given the fused path on CUDA)."""
    rows = gate_up.numel() // max(1, gate_up.shape[-1])
    return (0 < rows <= MAX_FUSED_ROWS and gate_up.dtype in _FUSED_DTYPES
            and weight.dtype == gate_up.dtype and gate_up.stride(-1) == 1 and weight.stride(-1) == 1)


def swiglu_down(gate_up: Tensor, weight: Tensor, *, impl: str = "fused") -> Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``, projected by ``weight (H, I)``: ``(..., 2I) -> (..., H)``.

    ``impl`` picks the kernels (:mod:`bcg.ops.kernels.dispatch`); with ``"fused"`` on CUDA, up to
    :data:`MAX_FUSED_ROWS` rows of bf16/fp16 run as one kernel, everything else as
    :func:`~bcg.ops.kernels.silu_and_mul` and ``F.linear``. The kernel keeps one counter per output tile in a
    per-device buffer (:mod:`bcg.ops.kernels.tile_counters`), so launches of it on two streams of one device must not
    run at the same time.

    Example:
        >>> x, w = torch.randn(3, 10), torch.randn(4, 5)
        >>> torch.allclose(swiglu_down(x, w), (F.silu(x[:, :5]) * x[:, 5:]) @ w.T)
        True
    """
    if gate_up.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"swiglu_down needs gate_up (..., 2I) for a weight (H, I); got {tuple(gate_up.shape)} and "
                         f"{tuple(weight.shape)}")
    if kernel_path(impl, gate_up) != "triton" or not is_fused(gate_up, weight):
        return F.linear(silu_and_mul(gate_up, impl=impl), weight)
    from bcg.ops.kernels import triton_down_proj

    rows, cols = gate_up.numel() // gate_up.shape[-1], weight.shape[0]
    plan = triton_down_proj.tiling(rows, cols, weight.shape[1], num_sms(gate_up.device))
    out = gate_up.new_empty((*gate_up.shape[:-1], cols))
    # One split writes the output directly; the partials buffer is then never read, so a 1-element one stands in.
    partials = gate_up.new_empty(plan.split_k * rows * cols if plan.split_k > 1 else 1, dtype=torch.float32)
    counters = tile_counters(gate_up.device, plan.tiles, "swiglu_down")
    triton_down_proj.swiglu_down(gate_up, weight, out, partials, counters, plan)
    return out
