"""Building blocks shared by the model zoo: RMSNorm, rotary embedding and the SwiGLU MLP.

Everything here is capturable: fixed shapes, no host reads, no data-dependent control flow. Modules with a
``kernels`` attribute run either plain torch ops (``"torch"``) or the fused kernels of :mod:`bcg.ops.kernels`
(``"fused"``: Triton on CUDA, the same references elsewhere); :meth:`bcg.models.base.CausalLM.set_kernels` sets it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg import env
from bcg.models.parallel_layers import column_linear, even_part, row_linear
from bcg.ops import kernels as fused
from bcg.ops.kernels.rope import rope_angles, rotate
from bcg.ops.parallel import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale.

    Example:
        >>> norm = RMSNorm(16)
        >>> norm(torch.randn(3, 4, 16)).shape
        torch.Size([3, 4, 16])
    """

    kernels: str = "torch"

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels == "fused":
            return fused.rms_norm(x, self.weight, self.eps, impl="fused")
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add(self, x: Tensor, residual: Tensor, inplace: bool = True) -> tuple[Tensor, Tensor]:
        """``(norm(residual + x), residual + x)``, the sum rounded to the residual's dtype: a decoder layer's
        ``h = h + sublayer(...)`` and the next norm. Fused, it is one kernel, in place on ``x`` (overwritten with the
        normed rows) and on ``residual`` unless ``inplace=False`` (a graph's static input must not change).

        Example:
            >>> norm, x, h = RMSNorm(8), torch.randn(2, 8), torch.randn(2, 8)
            >>> normed, h2 = norm.add(x, h)
            >>> torch.equal(h2, h + x) and torch.equal(normed, norm(h + x))
            True
        """
        if self.kernels == "fused":
            out = None if inplace else torch.empty_like(residual)
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps, residual_out=out, impl="fused")
        residual = fused.add_partials(x, residual) if x.dim() == residual.dim() + 1 else residual + x
        return self(residual), residual


class Rope(NamedTuple):
    """One forward's rotary positions: ``positions`` and ``inv_freq`` (what a fused kernel rotates by), and the
    ``cos``/``sin`` tables the torch path rotates by (None when the kernels compute them on the fly)."""

    positions: Tensor
    inv_freq: Tensor
    cos: Tensor | None
    sin: Tensor | None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (non-interleaved "rotate half" layout, as in Llama/Qwen).

    ``forward(positions)`` turns an int tensor of positions into ``cos, sin`` of shape ``(T, 1, head_dim)`` on the
    device (:func:`~bcg.ops.kernels.rope.rope_angles`: ``sin`` with its first half negated), so it can sit inside a
    captured graph: nothing is read back to the host and no table is sized by the largest position seen.

    Example:
        >>> rope = RotaryEmbedding(16)
        >>> cos, sin = rope(torch.arange(5))
        >>> apply_rotary(torch.randn(5, 4, 16), cos, sin).shape
        torch.Size([5, 4, 16])
    """

    inv_freq: Tensor
    kernels: str = "torch"

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)

    def _inv_freq(self, device: torch.device) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` in fp32 on its device.

        Needed after ``to_empty`` (meta init) and after a model-wide ``.to(bf16)``, which would
        otherwise leave the frequencies empty or rounded.
        """
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_angles(positions, self.inv_freq)

    def rope(self, positions: Tensor) -> Rope:
        """The :class:`Rope` of one forward: ``cos``/``sin`` computed here for the torch path, left to the fused
        q/k kernel (which computes the angles itself) otherwise."""
        if self.kernels == "fused":
            return Rope(positions, self.inv_freq, None, None)
        return Rope(positions, self.inv_freq, *self(positions))


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`~bcg.ops.kernels.rope.rotate`, cast back to ``x.dtype``.

    Example:
        >>> cos, sin = RotaryEmbedding(8)(torch.arange(3))
        >>> apply_rotary(torch.randn(3, 2, 8, dtype=torch.bfloat16), cos, sin).dtype
        torch.bfloat16
    """
    return rotate(x, cos, sin).to(x.dtype)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    Tensor parallel: gate and up column-parallel (each rank ``intermediate_size / tp.size`` of both), down
    row-parallel (one all-reduce). With the fused kernels SiLU-and-multiply rides the gate/up projection's epilogue
    at short prompts (:func:`~bcg.ops.kernels.gate_up_silu`; ``BCG_MLP_FUSION`` in :mod:`bcg.env` picks another).

    Example:
        >>> mlp = SwiGLUMLP(64, 128)
        >>> mlp(torch.randn(3, 64)).shape
        torch.Size([3, 64])
    """

    kernels: str = "torch"
    # Set by a model whose next step after this MLP takes split-K partials (the next layer's add + RMSNorm): the
    # down projection may then leave them (bcg.ops.kernels.down_partials) instead of one (M, H) output; not while
    # BCG_INPUT_NORM_FUSION hands that add + norm to the q/k/v kernel, which takes one output.
    emits_partials: bool = False

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # One (2I, H) matmul instead of two (I, H) ones: fewer launches in a launch-bound prefill.
        part = even_part(intermediate_size, tp)
        self.gate_up_proj = column_linear(hidden_size, [part, part], bias=False, tp=tp)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias=False, tp=tp)

    def forward(self, x: Tensor, norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
        """The MLP of ``x``, or with ``norm_weight`` of ``rms_norm(x, norm_weight, eps)``: the norm before the MLP
        handed in to fold into the gate/up kernel (``BCG_NORM_FUSION``, :class:`bcg.models.dense.DecoderLayer`)."""
        if self.kernels == "fused":
            return swiglu_fused(x, self.gate_up_proj.weight, self.gate_up_proj.bias, self.down_proj, "fused",
                                norm_weight=norm_weight, eps=eps,
                                partials=self.emits_partials and not env.INPUT_NORM_FUSION)
        if norm_weight is not None:
            x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def swiglu_fused(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down: nn.Module,
                 impl: str, *, norm_weight: Tensor | None = None, eps: float = 1e-6, partials: bool = False) -> Tensor:
    """``down(silu(gate) * up)`` of the joined ``(2I, H)`` gate/up projection on the fused kernels, SiLU-and-multiply
    where ``BCG_MLP_FUSION`` puts it (:mod:`bcg.env`): in the gate/up projection's epilogue (the default), in a plain
    ``nn.Linear`` down projection's prologue, or a kernel of its own. Each fusion runs its one kernel only at short
    prompts and is the two steps elsewhere. With ``norm_weight`` the MLP's input is ``rms_norm(x, norm_weight,
    eps)``: folded into the gate/up kernel where that runs (:func:`~bcg.ops.kernels.gate_up_silu`), a kernel of its
    own otherwise. With ``partials`` (a caller whose next step is an add + RMSNorm) a plain bias-free down projection
    may return its split-K partials, ``(S, M, H)`` fp32, where :func:`~bcg.ops.kernels.num_splits` says so.

    Example:
        >>> mlp = SwiGLUMLP(8, 16)
        >>> x = torch.randn(3, 8)
        >>> torch.allclose(swiglu_fused(x, mlp.gate_up_proj.weight, None, mlp.down_proj, "fused"), mlp(x))
        True
    """
    if env.MLP_FUSION == "gate_up" and gate_up_bias is None:
        act = fused.gate_up_silu(x, gate_up_weight, norm_weight=norm_weight, eps=eps, impl=impl)
        return _down(act, down, impl, partials)
    if norm_weight is not None:
        x = fused.rms_norm(x, norm_weight, eps, impl=impl)
    gate_up = F.linear(x, gate_up_weight, gate_up_bias)
    if env.MLP_FUSION == "down" and type(down) is nn.Linear and down.bias is None:
        return fused.swiglu_down(gate_up, down.weight, impl=impl)
    return _down(fused.silu_and_mul(gate_up, impl=impl), down, impl, partials)


def _down(act: Tensor, down: nn.Module, impl: str, partials: bool) -> Tensor:
    """The down projection of ``act``: its split-K partials where the caller takes them and they run, else
    ``down(act)`` (a row-parallel projection under tensor parallel all-reduces its one output)."""
    if partials and type(down) is nn.Linear and down.bias is None:
        splits = fused.num_splits(act, down.weight, impl)
        if splits:
            return fused.down_partials(act, down.weight, splits, impl)
    return down(act)
