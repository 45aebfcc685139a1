# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""The MoE router after its matmul: scores, top-k, the k weights: one kernel on CUDA (three to twelve in plain torch).

Three rules cover the routers of the families bcg runs (``rule``):

* ``"softmax_topk"`` (Qwen3-MoE, Mixtral, bcg's native MoE): fp32 softmax over the experts, the top-k
  probabilities, optionally divided by their fp32 sum (``renormalize``);
* ``"topk_softmax"`` (gpt-oss): the top-k logits (a router bias is already in them), then an fp32 softmax over those
  k values;
* ``"sigmoid_topk"`` (GLM-4.5, DeepSeek-V3): fp32 sigmoid scores; the choice ranks ``score + correction_bias``
  (the bias only chooses, it is not in the weights), within the best ``topk_group`` of ``n_group`` expert groups
  (a group ranks by the sum of its two best choice scores; other groups' experts are never chosen); the chosen
  experts' scores, optionally divided by their fp32 sum plus 1e-20 (DeepSeek-V3's guard), are the weights.

Then every rule multiplies the weights by ``scaling`` (``routed_scaling_factor``; exact for 1.0) and rounds them
once to ``out_dtype``. With ``num_shared`` the result has ``k + num_shared`` columns: the shared experts ``E, E + 1,
...`` with weight 1, so that they run as routed experts of the stacked weights (always chosen, in every token's
last columns). Ids are int64 in descending order of the choice score. Ties (equal scores, e.g. an all-zero padding
row, or two bf16 logits) go to the lower expert id (and group id) in the fused kernel; ``torch.topk`` leaves their
order unspecified. The plain-torch reference is the CPU path and the kernel's contract.
"""

from typing import Optional

import torch
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["ROUTER_RULES", "router_topk", "router_topk_reference"]

ROUTER_RULES = ("softmax_topk", "topk_softmax", "sigmoid_topk")
SIGMOID_RENORM_EPS = 1e-20  # DeepSeek-V3's guard in the renormalisation of sigmoid weights


def router_topk_reference(logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype,
                          rule: str = "softmax_topk", correction_bias: Optional[Tensor] = None, n_group: int = 1,
                          topk_group: int = 1, scaling: float = 1.0,
                          num_shared: int = 0) -> tuple[Tensor, Tensor]:
    """Plain-torch router: ``(T, E)`` logits -> weights ``(T, k + num_shared)`` in ``out_dtype`` and int64 ids."""
    if rule == "softmax_topk":
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif rule == "topk_softmax":
        values, ids = logits.topk(top_k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=torch.float32)
    else:
        scores = logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        ids = _best_groups_only(choice, n_group, topk_group).topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_RENORM_EPS)
    if scaling != 1.0:
        weights = weights * scaling
    weights = weights.to(out_dtype)
    if num_shared:
        shared = torch.arange(logits.shape[-1], logits.shape[-1] + num_shared, device=ids.device)
        ids = torch.cat([ids, shared.expand(ids.shape[0], num_shared)], dim=1)
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], num_shared)], dim=1)
    return weights, ids


def _best_groups_only(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """``choice`` with every expert outside the best ``topk_group`` groups at -inf (one group: unchanged)."""
    if n_group <= 1:
        return choice
    grouped = choice.view(choice.shape[0], n_group, choice.shape[1] // n_group)
    best = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(topk_group, dim=-1)[1]
    keep = torch.zeros(choice.shape[0], n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def router_topk(logits: Tensor, top_k: int, *, renormalize: bool = True, out_dtype: Optional[torch.dtype] = None,
                rule: str = "softmax_topk", correction_bias: Optional[Tensor] = None, n_group: int = 1,
                topk_group: int = 1, scaling: float = 1.0, num_shared: int = 0,
                impl: str = "fused") -> tuple[Tensor, Tensor]:
    """Top-``top_k`` experts per token from router ``logits (T, E)`` (rows may be strided) by ``rule`` (see the
    module doc; ``renormalize`` is Qwen3-MoE's and GLM's ``norm_topk_prob``, and must be False for
    ``"topk_softmax"``, whose k weights sum to one already).

    Returns ``(weights, ids)``: ``weights (T, k + num_shared)`` in ``out_dtype`` (default ``logits.dtype``) and int64
    ``ids (T, k + num_shared)``, the routed experts first, highest choice score first.

    Example:
        >>> w, ids = router_topk(torch.tensor([[0.0, 2.0, 1.0, -1.0]]), 2)
        >>> ids.tolist(), round(float(w.sum()), 6)
        ([[1, 2]], 1.0)
        >>> w, ids = router_topk(torch.tensor([[0.0, 2.0, 1.0, -1.0]]), 1, renormalize=False, rule="sigmoid_topk",
        ...                      correction_bias=torch.tensor([0.0, 0.0, 0.5, 0.0]), scaling=2.0, num_shared=1)
        >>> ids.tolist(), [round(v, 4) for v in w[0].tolist()]
        ([[2, 4]], [1.4621, 1.0])
    """
    _check(logits, top_k, renormalize, rule, correction_bias, n_group, topk_group, num_shared)
    out_dtype = logits.dtype if out_dtype is None else out_dtype
    args = (top_k, renormalize, out_dtype, rule, correction_bias, n_group, topk_group, float(scaling), num_shared)
    path = kernel_path(impl, logits)
    if path == "torch":
        return router_topk_reference(logits, *args)
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (T, E) with a contiguous last dimension, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if path == "op":
        return torch.ops.bcg.router_topk(logits, *args)
    return _router_topk_triton(logits, *args)


def _check(logits: Tensor, top_k: int, renormalize: bool, rule: str, correction_bias: Optional[Tensor], n_group: int,
           topk_group: int, num_shared: int) -> None:
    num_experts = logits.shape[-1]
    problems = []
    if rule not in ROUTER_RULES:
        problems.append(f"rule={rule!r} is none of {', '.join(ROUTER_RULES)}")
    if rule == "topk_softmax" and renormalize:
        problems.append("renormalize=True with rule='topk_softmax': its k weights sum to one already; pass False")
    if correction_bias is not None and (rule != "sigmoid_topk" or correction_bias.shape != (num_experts,)):
        problems.append(f"correction_bias {tuple(correction_bias.shape)} needs rule='sigmoid_topk' and shape "
                        f"({num_experts},)")
    if n_group != 1 and (rule != "sigmoid_topk" or n_group < 1 or num_experts % n_group
                         or num_experts // n_group < 2 or not 1 <= topk_group <= n_group):
        problems.append(f"n_group={n_group}, topk_group={topk_group}: groups need rule='sigmoid_topk', at least two "
                        f"experts each out of {num_experts}, and 1 <= topk_group <= n_group")
    groups_kept = topk_group * (num_experts // n_group) if n_group > 1 else num_experts
    if not 0 < top_k <= groups_kept:
        problems.append(f"top_k={top_k} must be in [1, {groups_kept}] (the number of experts"
                        + (" in the groups kept)" if n_group > 1 else ")"))
    if num_shared < 0:
        problems.append(f"num_shared={num_shared} is negative")
    if problems:
        raise ValueError("router_topk: " + "; ".join(problems))


# --- The op (bcg.ops.kernels.library): it allocates its results as its fake kernel does, then fills them. ---
def _router_topk_fake(logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, rule: str,
                      correction_bias: Optional[Tensor], n_group: int, topk_group: int, scaling: float,
                      num_shared: int) -> tuple[Tensor, Tensor]:
    cols = top_k + num_shared
    return (logits.new_empty((logits.shape[0], cols), dtype=out_dtype),
            logits.new_empty((logits.shape[0], cols), dtype=torch.int64))


def _router_topk_op(logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, rule: str,
                    correction_bias: Optional[Tensor], n_group: int, topk_group: int, scaling: float,
                    num_shared: int) -> tuple[Tensor, Tensor]:
    args = (top_k, renormalize, out_dtype, rule, correction_bias, n_group, topk_group, scaling, num_shared)
    weights, ids = _router_topk_fake(logits, *args)
    ref_weights, ref_ids = router_topk_reference(logits, *args)
    return weights.copy_(ref_weights), ids.copy_(ref_ids)


def _router_topk_triton(logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, rule: str,
                        correction_bias: Optional[Tensor], n_group: int, topk_group: int, scaling: float,
                        num_shared: int) -> tuple[Tensor, Tensor]:
    from bcg.ops.kernels import triton_moe

    weights, ids = _router_topk_fake(logits, top_k, renormalize, out_dtype, rule, correction_bias, n_group,
                                     topk_group, scaling, num_shared)
    triton_moe.router_topk(logits, top_k, renormalize, ROUTER_RULES.index(rule), correction_bias, n_group,
                           topk_group, scaling, weights, ids)
    return weights, ids


kernel_op("router_topk", mutates_args=(), reference=_router_topk_op, triton=_router_topk_triton,
          fake=_router_topk_fake)
