# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""RMSNorm, and RMSNorm with the residual add fused in (in place), as one kernel each on CUDA.

Numerics (both implementations): the row's mean square is reduced in fp32 and the output is
``x * rsqrt(mean(x^2) + eps) * weight`` computed in fp32 and rounded once to the output dtype, as
``torch.nn.functional.rms_norm`` does. The fused add rounds ``x + residual`` to the residual's dtype first (exactly
what ``hidden = hidden + attn_out`` does in bf16) and normalises that rounded sum, so the residual stream carries the
same bits as the unfused code.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["add_partials", "fused_add_rms_norm", "fused_add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain-torch RMSNorm over the last dimension (the CPU path and the fused kernel's oracle)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Plain-torch ``residual += x; x[:] = rms_norm(residual) * weight``; returns ``(x, residual)``."""
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))
    return x, residual


def _check_rows(name: str, t: Tensor, hidden: int) -> None:
    if t.shape[-1] != hidden or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension of size {hidden} (got shape {tuple(t.shape)}, strides "
            f"{t.stride()}); pass .contiguous() or a row-sliced view"
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, out: Optional[Tensor] = None,
             impl: str = "fused") -> Tensor:
    """RMSNorm over the last dimension of ``x`` (``(..., H)``, rows may be strided), scaled by ``weight`` ``(H,)``.

    Writes ``out`` when given (same shape, any dtype, contiguous last dimension), else returns a new tensor of
    ``x``'s dtype. ``impl`` picks the kernel (:mod:`bcg.ops.kernels.dispatch`).

    Example:
        >>> x = torch.randn(3, 1000)
        >>> torch.allclose(rms_norm(x, torch.ones(1000), 1e-6), F.rms_norm(x, (1000,), None, 1e-6))
        True
    """
    path = kernel_path(impl, x)
    if path == "torch":
        y = rms_norm_reference(x, weight, eps)
        return y if out is None else out.copy_(y)
    _check_rows("x", x, weight.shape[0])
    if path == "op":
        y = torch.ops.bcg.rms_norm(x, weight, eps)
        return y if out is None else out.copy_(y)
    from bcg.ops.kernels import triton_norm

    out = torch.empty_like(x) if out is None else out
    triton_norm.rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, out: Optional[Tensor] = None,
                       residual_out: Optional[Tensor] = None, impl: str = "fused") -> tuple[Tensor, Tensor]:
    """``residual + x`` (rounded to ``residual.dtype``) and its RMSNorm, in place by default.

    In place (no ``out``/``residual_out``): ``residual += x``, then ``x[:] = rms_norm(residual) * weight``; returns
    ``(x, residual)``, the normed rows (the next sublayer's input) and the updated residual stream. A decoder
    layer's ``h = h + attn(n); n = norm(h)`` becomes ``n, h = fused_add_rms_norm(attn_out, h, w, eps)``: one kernel.
    ``out``/``residual_out`` redirect either result instead (e.g. to leave a graph's static input untouched in the
    first layer); the inputs are then only read. All are ``(..., H)`` with a contiguous last dimension, and no two
    of them may overlap unless they are the same tensor.

    Example:
        >>> x, h = torch.randn(4, 64), torch.randn(4, 64)
        >>> expected = F.rms_norm(x + h, (64,), None, 1e-6)
        >>> n, h2 = fused_add_rms_norm(x, h, torch.ones(64), 1e-6)
        >>> n is x and h2 is h and torch.allclose(n, expected)
        True
    """
    is_partials = x.dim() == residual.dim() + 1
    if is_partials:  # a split-K GEMM's fp32 partials (bcg.ops.kernels.down_partials): summed as they are read
        if x.shape[1:] != residual.shape or x.dtype != torch.float32:
            raise ValueError(f"partials {tuple(x.shape)} {x.dtype} must be float32 (S, *residual.shape) for "
                             f"residual {tuple(residual.shape)}")
        out = torch.empty_like(residual) if out is None else out  # the normed rows cannot go back into x
    elif x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    out = x if out is None else out
    residual_out = residual if residual_out is None else residual_out
    path = kernel_path(impl, x)
    if path == "torch":
        if is_partials:
            residual_out.copy_(add_partials(x, residual))
        else:
            if residual_out is not residual:
                residual_out.copy_(residual)
            residual_out.add_(x)
        return out.copy_(rms_norm_reference(residual_out, weight, eps)), residual_out
    if is_partials and path == "op":  # a trace never makes partials; should one reach it, the sum first
        x = x.sum(0).to(residual.dtype)
    for name, t in (("x", x), ("residual", residual), ("out", out), ("residual_out", residual_out)):
        _check_rows(name, t, weight.shape[0])
    if path == "op":
        if out is x and residual_out is residual:  # in place: the residual stream, often an input of the trace
            torch.ops.bcg.fused_add_rms_norm_(x, residual, weight, eps)
            return x, residual
        # Redirected: new results copied where asked (Inductor drops a copy into a fresh tensor).
        normed, summed = torch.ops.bcg.add_rms_norm(x, residual, weight, eps)
        return out.copy_(normed), residual_out.copy_(summed)
    from bcg.ops.kernels import triton_norm

    triton_norm.add_rms_norm(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def add_partials(partials: Tensor, residual: Tensor) -> Tensor:
    """``residual + partials.sum(0)``, summed in fp32 in the partials' order and rounded once to the residual's dtype
    (what the fused kernel computes).

    Example:
        >>> p, h = torch.randn(4, 2, 8), torch.randn(2, 8, dtype=torch.bfloat16)
        >>> add_partials(p, h).dtype
        torch.bfloat16
    """
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return (total + residual.float()).to(residual.dtype)


# --- The ops (bcg.ops.kernels.library): each allocates its results as its fake kernel does, then fills them. ---
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _rms_norm_fake(x, weight, eps).copy_(rms_norm_reference(x, weight, eps))


def _rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from bcg.ops.kernels import triton_norm

    out = _rms_norm_fake(x, weight, eps)
    triton_norm.rms_norm(x, weight, eps, out)
    return out


def _add_rms_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), residual.new_empty(residual.shape)


def _add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    normed, summed = _add_rms_norm_fake(x, residual, weight, eps)
    fused_add_rms_norm_reference(normed.copy_(x), summed.copy_(residual), weight, eps)
    return normed, summed


def _add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from bcg.ops.kernels import triton_norm

    normed, summed = _add_rms_norm_fake(x, residual, weight, eps)
    triton_norm.add_rms_norm(x, residual, weight, eps, normed, summed)
    return normed, summed


def _add_rms_norm_inplace_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    return None


def _add_rms_norm_inplace_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    fused_add_rms_norm_reference(x, residual, weight, eps)


def _add_rms_norm_inplace_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    from bcg.ops.kernels import triton_norm

    triton_norm.add_rms_norm(x, residual, weight, eps, x, residual)


kernel_op("rms_norm", mutates_args=(), reference=_rms_norm_op, triton=_rms_norm_triton, fake=_rms_norm_fake)
kernel_op("add_rms_norm", mutates_args=(), reference=_add_rms_norm_op, triton=_add_rms_norm_triton,
          fake=_add_rms_norm_fake)
kernel_op("fused_add_rms_norm_", mutates_args=("x", "residual"), reference=_add_rms_norm_inplace_op,
          triton=_add_rms_norm_inplace_triton, fake=_add_rms_norm_inplace_fake)
