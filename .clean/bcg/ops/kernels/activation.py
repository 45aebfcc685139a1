# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""The activations between an MLP's gate/up and down projections, ``(T, 2I) -> (T, I)`` in one kernel on CUDA.

* :func:`silu_and_mul`: ``silu(gate) * up`` on gate and up halves. ``silu(gate)`` is computed in fp32 and rounded to
  the input dtype, then multiplied by ``up`` in fp32 and rounded again, the two roundings of eager torch.
* :func:`clamped_swiglu`: gpt-oss's experts on interleaved gate/up columns, with each row's expert bias added first:
  ``gate = min(g, limit)``, ``up = clamp(u, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``. Every op
  computes in fp32 and rounds to the input dtype where the module's torch ops round (six roundings in bf16), so
  the kernel and the reference are the module's arithmetic; in plain torch it is nine kernels, with the bias two.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["clamped_swiglu", "clamped_swiglu_reference", "silu_and_mul", "silu_and_mul_reference"]


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


def clamped_swiglu_reference(gate_up: Tensor, bias: Optional[Tensor], expert: Optional[Tensor], alpha: float,
                             limit: float) -> Tensor:
    """Plain torch, gpt-oss's ops in its order: ``(..., 2I)`` interleaved gate/up rows (plus ``bias[expert]``) ->
    ``(..., I)``."""
    if bias is not None:
        gate_up = gate_up + bias[expert]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def clamped_swiglu(gate_up: Tensor, bias: Optional[Tensor], expert: Tensor, alpha: float, limit: float, *,
                   impl: str = "fused") -> Tensor:
    """gpt-oss's expert activation on rows ``gate_up (R, 2I)`` of interleaved gate/up columns (rows may be strided),
    each row's expert bias ``bias (E, 2I)`` (or None) added first, ``expert (R,)`` the row's expert.

    Example:
        >>> x, b = torch.randn(3, 8), torch.randn(2, 8)
        >>> e = torch.tensor([0, 1, 1])
        >>> y = clamped_swiglu(x, b, e, 1.702, 7.0)
        >>> g, u = (x + b[e])[:, ::2].clamp(max=7.0), (x + b[e])[:, 1::2].clamp(-7.0, 7.0)
        >>> torch.allclose(y, (u + 1) * g * torch.sigmoid(1.702 * g))
        True
    """
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2 or expert.shape != gate_up.shape[:1] or (
            bias is not None and (bias.dim() != 2 or bias.shape[1] != gate_up.shape[1])):
        raise ValueError(f"clamped_swiglu needs gate_up (R, 2I), expert (R,) and bias (E, 2I) or None; got "
                         f"{tuple(gate_up.shape)}, {tuple(expert.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)}")
    path = kernel_path(impl, gate_up)
    if path == "torch":
        return clamped_swiglu_reference(gate_up, bias, expert, alpha, limit)
    if gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must have a contiguous last dimension (strides {gate_up.stride()})")
    if path == "op":
        return torch.ops.bcg.clamped_swiglu(gate_up, bias, expert, float(alpha), float(limit))
    return _clamped_swiglu_triton(gate_up, bias, expert, float(alpha), float(limit))


def _clamped_swiglu_fake(gate_up: Tensor, bias: Optional[Tensor], expert: Tensor, alpha: float,
                         limit: float) -> Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _clamped_swiglu_op(gate_up: Tensor, bias: Optional[Tensor], expert: Tensor, alpha: float,
                       limit: float) -> Tensor:
    out = _clamped_swiglu_fake(gate_up, bias, expert, alpha, limit)
    return out.copy_(clamped_swiglu_reference(gate_up, bias, expert, alpha, limit))


def _clamped_swiglu_triton(gate_up: Tensor, bias: Optional[Tensor], expert: Tensor, alpha: float,
                           limit: float) -> Tensor:
    from bcg.ops.kernels import triton_activation

    out = _clamped_swiglu_fake(gate_up, bias, expert, alpha, limit)
    triton_activation.clamped_swiglu(gate_up, bias, expert, alpha, limit, out)
    return out


kernel_op("clamped_swiglu", mutates_args=(), reference=_clamped_swiglu_op, triton=_clamped_swiglu_triton,
          fake=_clamped_swiglu_fake)
