"""How a transformers MoE block's stacked experts compute, as :class:`~bcg.models.hf.fused_moe.FusedMoE` and the
shared experts stacked with them (:mod:`bcg.models.hf.moe_shared`) read it: the weights as stored, optional biases,
the activation between the two grouped GEMMs."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from bcg.ops import kernels as fused

__all__ = ["ACTIVATIONS", "ExpertsSpec"]

ACTIVATIONS = ("silu", "silu_interleaved", "clamped_swiglu")


@dataclass
class ExpertsSpec:
    """How the stacked experts compute: weights as stored, optional biases, the activation between the GEMMs."""

    gate_up: Tensor  # (E, 2I, H), or (E, H, 2I) when transposed
    down: Tensor  # (E, H, I), or (E, I, H) when transposed
    gate_up_bias: Tensor | None  # (E, 2I)
    down_bias: Tensor | None  # (E, H)
    transposed: bool
    activation: str  # one of ACTIVATIONS
    alpha: float = 1.0
    limit: float = float("inf")

    def matrix(self, weight: Tensor) -> Tensor:
        """The ``(E, in, out)`` view ``grouped_mm`` multiplies by (no copy)."""
        return weight if self.transposed else weight.transpose(-2, -1)

    def activate(self, gate_up: Tensor, impl: str) -> Tensor:
        if self.activation == "silu":
            return fused.silu_and_mul(gate_up, impl=impl)
        if self.activation == "silu_interleaved":
            return F.silu(gate_up[..., ::2]) * gate_up[..., 1::2]
        # gpt_oss's arithmetic, in its order (the clamps are exact; the products round as the module's do).
        return fused.clamped_swiglu_reference(gate_up, None, None, self.alpha, self.limit)
