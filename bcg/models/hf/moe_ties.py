"""Routing near-ties: the tokens whose output may differ from a module's only because a router chose between two
experts whose scores are within rounding of each other.

A router's top-k is discontinuous: when a token's k-th and (k+1)-th choice scores are within rounding, any other
rounding upstream (a residual add and RMSNorm in one kernel instead of two, a GEMM's accumulation order) can hand the
token to the other expert, and its output changes by a whole expert's contribution. In bf16, with 8 to 128 experts,
such ties are common: router logits have 8 significant bits. Neither choice is more right than the other (the
module itself would pick the other on another device), so when a fused stand-in differs from its module, the
fusion's check leaves those tokens out (:func:`near_tie_rows`) and requires the rest to match; a difference on any
other token still rejects the stand-in.

Near means a gap (relative to the token's largest choice score, :meth:`~.moe_routing.RouterSpec.margin`) within the
comparison's own tolerance for the dtype (2e-2 for bf16, 2e-5 for fp32), and at most a quarter of the tokens may
be left out: more than that is not a tie but a different computation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from bcg.models.hf.fused_moe import FusedMoE

__all__ = ["MAX_TIE_FRACTION", "near_tie_rows"]

MAX_TIE_FRACTION = 0.25


def near_tie_rows(module: nn.Module, recorded_input: Callable[[nn.Module], Any], tolerance: float) -> Tensor | None:
    """The tokens (bool ``(T,)``) of ``module``'s recorded call at a routing near-tie in an MoE block it is or holds,
    or None where it holds no fused MoE block, none of its tokens is near a tie, or too many are.

    Args:
        module: the module being checked (an MoE block's stand-in, or a decoder layer whose ``mlp`` is one).
        recorded_input: the recorded first positional argument of a module of the model as written (or None).
        tolerance: the comparison's relative tolerance for the dtype.
    """
    blocks = [m for m in module.modules() if isinstance(m, FusedMoE)]
    if len(blocks) != 1:
        return None
    block = blocks[0]
    x = recorded_input(block.original)
    if not isinstance(x, Tensor):
        return None
    with torch.inference_mode():
        ties = block.spec.router.margin(x.reshape(-1, x.shape[-1])) <= tolerance
    n = int(ties.sum())
    if n == 0 or n > MAX_TIE_FRACTION * ties.numel():
        return None
    return ties
