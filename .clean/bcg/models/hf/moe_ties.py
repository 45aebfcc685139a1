"""Routing near-ties: the tokens whose output may differ from a module's only because a router chose between two
experts whose scores are within rounding of each other.

A router's top-k is discontinuous: when a token's k-th and (k+1)-th choice scores are within rounding, any other
rounding upstream (a residual add and RMSNorm in one kernel instead of two, a GEMM's accumulation order) can hand the
token to the other expert, and its output changes by a whole expert's contribution. In bf16, with 8 to 128 experts,
such ties are common: router logits have 8 significant bits. Neither choice is more right than the other (the
module itself would pick the other on another device), so when a fused stand-in differs from its module, the
fusion's check leaves out the tokens whose routing *changed* (:func:`near_tie_rows`) and requires the rest to match;
a difference on any other token still rejects the stand-in.

A token is left out only if the stand-in's MoE block routed it to other experts than the module's router did on the
module's own input, and its routing was near a tie: a gap (relative to the token's largest choice score,
:meth:`~.moe_routing.RouterSpec.margin`) within the comparison's own tolerance for the dtype (2e-2 for bf16, 2e-5
for fp32) on either input. A token routed otherwise far from a tie means a different computation, and so do changes
on more than a quarter of the tokens. Near ties themselves are not left out: in bf16 with 32 experts and top-4, half
of a probe's tokens can be near one (the H200 measured 7 of 16 in one qwen3_moe layer), while one of them changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from bcg.models.hf.fused_moe import FusedMoE

__all__ = ["MAX_TIE_FRACTION", "MoEInputs", "near_tie_rows"]

MAX_TIE_FRACTION = 0.25


class MoEInputs:
    """Records the input of every fused MoE block inside ``module`` while it runs (a context manager), so the check
    can route what the stand-in's block saw.

    Example::

        with MoEInputs(stand_in) as seen:
            got = stand_in(*args)
        seen.inputs[block]          # the block's first input in that run
    """

    def __init__(self, module: nn.Module) -> None:
        self.blocks = [m for m in module.modules() if isinstance(m, FusedMoE)]
        self.inputs: dict[nn.Module, Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> MoEInputs:
        def hook(block: nn.Module, args: tuple) -> None:
            if block not in self.inputs and args and isinstance(args[0], Tensor):
                self.inputs[block] = args[0].detach().clone()

        self._handles = [b.register_forward_pre_hook(hook) for b in self.blocks]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def near_tie_rows(seen: MoEInputs, recorded_input: Callable[[nn.Module], Any], tolerance: float) -> Tensor | None:
    """The tokens (bool ``(T,)``) of one checked call that a fused MoE block routed otherwise than its module, each at
    a routing near-tie; None where the call ran no single fused MoE block, no token's routing changed, one changed far
    from a tie, or too many changed.

    Args:
        seen: the inputs the stand-in's fused MoE blocks got in the checked call (an MoE block's stand-in, or a
            decoder layer whose ``mlp`` is one).
        recorded_input: the recorded first positional argument of a module of the model as written (or None).
        tolerance: the comparison's relative tolerance for the dtype.
    """
    if len(seen.blocks) != 1 or seen.blocks[0] not in seen.inputs:
        return None
    block = seen.blocks[0]
    want_x, got_x = recorded_input(block.original), seen.inputs[block]
    if not isinstance(want_x, Tensor) or want_x.shape != got_x.shape:
        return None
    spec = block.spec.router
    want_x, got_x = want_x.reshape(-1, want_x.shape[-1]), got_x.reshape(-1, got_x.shape[-1])
    with torch.inference_mode():
        want_ids = getattr(block.original, block.spec.router_name)(want_x)[2]  # the module's router, as written
        got_ids = spec.route(got_x, block.kernels)[1][:, : spec.top_k]
        changed = (want_ids.sort(dim=-1).values != got_ids.sort(dim=-1).values).any(dim=-1)
        near = torch.minimum(spec.margin(want_x), spec.margin(got_x)) <= tolerance
    n = int(changed.sum())
    if n == 0 or n > MAX_TIE_FRACTION * changed.numel() or bool((changed & ~near).any()):
        return None
    return changed
