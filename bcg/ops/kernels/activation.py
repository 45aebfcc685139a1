# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""SiLU-and-multiply on a fused gate/up projection: ``(T, 2I) -> (T, I)`` in one kernel on CUDA.

Numerics (both implementations): ``silu(gate)`` is computed in fp32 and rounded to the input dtype, then
multiplied by ``up`` in fp32 and rounded again, the two roundings of ``F.silu(gate) * up`` in eager torch.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["silu_and_mul", "silu_and_mul_reference"]


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """Plain-torch ``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: Tensor, *, out: Optional[Tensor] = None, impl: str = "fused") -> Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of shape ``(..., 2I)`` (rows may be strided).

    Writes ``out`` ``(..., I)`` when given, else returns a new tensor of ``x``'s dtype.

    Example:
        >>> x = torch.randn(3, 10)
        >>> torch.equal(silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])
        True
    """
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension (gate and up halves), got {tuple(x.shape)}")
    path = kernel_path(impl, x)
    if path == "torch":
        y = silu_and_mul_reference(x)
        return y if out is None else out.copy_(y)
    if x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dimension (strides {x.stride()}); pass x.contiguous()")
    if path == "op":
        y = torch.ops.bcg.silu_and_mul(x)
        return y if out is None else out.copy_(y)
    from bcg.ops.kernels import triton_activation

    out = _silu_and_mul_fake(x) if out is None else out
    triton_activation.silu_and_mul(x, out)
    return out


# --- The op (bcg.ops.kernels.library): it allocates its result as its fake kernel does, then fills it. ---
def _silu_and_mul_fake(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _silu_and_mul_op(x: Tensor) -> Tensor:
    return _silu_and_mul_fake(x).copy_(silu_and_mul_reference(x))


def _silu_and_mul_triton(x: Tensor) -> Tensor:
    from bcg.ops.kernels import triton_activation

    out = _silu_and_mul_fake(x)
    triton_activation.silu_and_mul(x, out)
    return out


kernel_op("silu_and_mul", mutates_args=(), reference=_silu_and_mul_op, triton=_silu_and_mul_triton,
          fake=_silu_and_mul_fake)
