"""The routing rules of transformers' mixture-of-experts routers, computed with fixed shapes on bcg's kernels.

A router maps a token's hidden state to ``k`` expert ids and their weights. Three rules cover the families bcg fuses:

* ``"softmax_topk"`` (qwen3_moe, mixtral): fp32 softmax over the experts' logits, top-k, optionally renormalised to
  sum to one. The weights stay fp32 (mixtral) or are rounded to the logits' dtype (qwen3_moe), as the router returns
  them;
* ``"topk_softmax"`` (gpt_oss): top-k of the (biased) logits, then a softmax over those k;
* ``"sigmoid_topk"`` (glm4_moe, the DeepSeek-V3 rule): sigmoid scores in fp32, a correction bias added for the
  choice only, top-k within the best ``topk_group`` of ``n_group`` expert groups (a group scores the sum of its two
  best), the chosen experts' unbiased scores optionally renormalised, times ``routed_scaling_factor``.

Each rule runs as the router's GEMM and one kernel (:func:`bcg.ops.kernels.router_topk`, whose plain-torch reference
runs on the CPU), which also emits the shared experts stacked after the routed ones (:mod:`bcg.models.hf.moe_shared`)
as ``num_shared`` more columns of weight 1, not scaled.

Which rule a router runs is read from its attributes and then checked on a random input against the router's own
output (:func:`router_spec`): the ids must be the same sets and the weights equal to rounding. :meth:`RouterSpec.margin`
is how close a token's routing is to a tie (the gap between the k-th and the (k+1)-th choice score): a token whose
gap is within rounding may take the other expert after any rounding upstream, which the fusion's check allows for.

Example:
    >>> spec = RouterSpec("softmax_topk", torch.eye(4), None, top_k=2, renormalize=True)
    >>> w, ids = spec.route(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), "torch")
    >>> ids.tolist(), round(float(w.sum()), 6)
    ([[1, 3]], 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.ops import kernels as fused

__all__ = ["RULES", "RouterSpec", "router_spec"]

RULES = ("softmax_topk", "topk_softmax", "sigmoid_topk")
# aten.mm with out_dtype (bf16/fp16 operands, fp32 result) runs on CUDA only, where torch has it
_HAS_MM_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


@dataclass
class RouterSpec:
    """One router's rule and parameters (see the module doc)."""

    rule: str
    weight: Tensor  # (E, H): the router's own parameter (a fp32 copy where the router computes in fp32)
    bias: Tensor | None  # (E,): gpt_oss's logit bias
    top_k: int
    renormalize: bool = False
    weights_fp32: bool = False  # the router returns fp32 weights (else the logits' dtype)
    logits_fp32: bool = False  # the router computes its logits in fp32 (glm4_moe)
    correction_bias: Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    num_shared: int = 0  # shared experts routed as experts E, E + 1, ... with weight 1 (after the scaling)
    weight_lowp: Tensor | None = None  # (E, H): the router's own bf16/fp16 weight where ``weight`` is its fp32 copy

    @property
    def num_experts(self) -> int:
        """The routed experts (the router's logits; shared experts come after them)."""
        return self.weight.shape[0]

    def logits(self, x: Tensor) -> Tensor:
        """``(T, H)`` -> ``(T, E)`` router logits, computed as the router does (one GEMM)."""
        w = self.weight_lowp
        if (self.logits_fp32 and w is not None and x.dtype == w.dtype and x.is_cuda and _HAS_MM_DTYPE
                and self.bias is None and not torch.compiler.is_compiling()):
            # A product of two bf16 (or fp16) values is exact in fp32, so a GEMM of the low-precision operands
            # accumulating and writing fp32 computes the router's fp32 logits without the input's cast: one kernel
            # where the cast, an fp32 GEMM and its split-K reduce were three.
            return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        return F.linear(x.float() if self.logits_fp32 else x, self.weight, self.bias)

    def route(self, x: Tensor, impl: str) -> tuple[Tensor, Tensor]:
        """``(T, H)`` -> top-k weights ``(T, k + num_shared)`` and int64 expert ids ``(T, k + num_shared)`` (the
        routed first), no host read: the logits' GEMM, then every rule in one kernel
        (:func:`bcg.ops.kernels.router_topk`)."""
        logits = self.logits(x)
        out = torch.float32 if self.weights_fp32 else logits.dtype
        return fused.router_topk(logits, self.top_k, renormalize=self.renormalize, out_dtype=out, rule=self.rule,
                                 correction_bias=self.correction_bias, n_group=self.n_group,
                                 topk_group=self.topk_group, scaling=self.scaling, num_shared=self.num_shared,
                                 impl=impl)

    def _choice(self, scores: Tensor) -> Tensor:
        """The sigmoid rule's choice scores: corrected, and outside the best groups -inf (one group: no mask)."""
        choice = scores + self.correction_bias
        if self.n_group <= 1:
            return choice
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def margin(self, x: Tensor) -> Tensor:
        """Per token, the gap between its k-th and (k+1)-th choice score over the largest score's magnitude:
        how far the routing is from a tie (fp32, ``(T,)``; +inf when every expert is chosen)."""
        logits = self.logits(x).float()
        choice = self._choice(logits.sigmoid()) if self.rule == "sigmoid_topk" else logits
        if self.top_k >= self.num_experts:
            return torch.full(choice.shape[:1], float("inf"), device=choice.device)
        top = choice.topk(self.top_k + 1, dim=-1)[0]
        scale = choice.abs().amax(dim=-1).clamp_min(1e-30)
        return (top[:, -2] - top[:, -1]) / scale


class NotARouter(Exception):
    """The module is not a router whose rule bcg knows; the message says how."""


def router_spec(router: nn.Module, top_k: int, renormalize: bool | None, dtype: torch.dtype) -> RouterSpec:
    """The rule ``router`` computes (see the module doc), checked against its own output on a random input.

    Args:
        router: the MoE block's router (its ``weight`` is ``(E, H)``).
        top_k: experts per token.
        renormalize: the block's or config's ``norm_topk_prob`` where it has one, else None (both are tried).
        dtype: the hidden states' dtype (the experts' weights').

    Raises:
        NotARouter: no known rule gives the router's output.
    """
    weight = getattr(router, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise NotARouter("its router has no (experts, hidden) weight")
    bias = getattr(router, "bias", None)
    correction = getattr(router, "e_score_correction_bias", None)
    candidates: list[RouterSpec] = []
    if isinstance(correction, Tensor):
        fp32 = weight if weight.dtype == torch.float32 else weight.detach().float()
        for renorm in _both(getattr(router, "norm_topk_prob", renormalize)):
            candidates.append(RouterSpec(
                "sigmoid_topk", fp32, None, top_k, renorm, True, True, correction.detach().float(),
                int(getattr(router, "num_group", getattr(router, "n_group", 1)) or 1),
                int(getattr(router, "topk_group", 1) or 1), float(getattr(router, "routed_scaling_factor", 1.0)),
                weight_lowp=weight if weight.dtype in (torch.bfloat16, torch.float16) else None))
    elif isinstance(bias, Tensor):
        candidates.append(RouterSpec("topk_softmax", weight, bias, top_k))
    else:
        for renorm in _both(getattr(router, "norm_topk_prob", renormalize)):
            for fp32_weights in (False, True):
                candidates.append(RouterSpec("softmax_topk", weight, None, top_k, renorm, fp32_weights))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, weight.shape[1], generator=g).to(weight.device, dtype)
    with torch.inference_mode():
        out = router(x)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise NotARouter(f"its router returns {type(out).__name__}, not (logits, weights, ids)")
        want_w, want_ids = out[1], out[2]
        for spec in candidates:
            if _same_routing(*spec.route(x, "torch"), want_w, want_ids):
                return spec
    raise NotARouter("its router matches none of the rules bcg fuses (softmax then top-k, top-k then softmax, "
                     "sigmoid with a correction bias)")


def _both(known: bool | None) -> tuple[bool, ...]:
    return (True, False) if known is None else (bool(known),)


def _same_routing(w: Tensor, ids: Tensor, want_w: Tensor, want_ids: Tensor) -> bool:
    """The same expert sets per token with the same weight per expert (to rounding), and the same weights dtype."""
    if w.shape != want_w.shape or ids.shape != want_ids.shape or w.dtype != want_w.dtype:
        return False
    mine, theirs = ids.sort(dim=-1), want_ids.sort(dim=-1)
    if not torch.equal(mine.values, theirs.values):
        return False
    a, b = w.gather(1, mine.indices).float(), want_w.gather(1, theirs.indices).float()
    return bool(((a - b).abs().max() <= 1e-2 * b.abs().max().clamp_min(1e-30)).item())
