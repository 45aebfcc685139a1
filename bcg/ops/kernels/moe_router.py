# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""The MoE router after its matmul: fp32 softmax over the experts, top-k, optional renormalisation of the k
weights, weights cast to the hidden dtype: one kernel on CUDA (five or more in plain torch).

Numerics (both implementations): the softmax is computed in fp32 (``exp(l - max) / sum``); the top-k weights are
the fp32 probabilities, divided by their fp32 sum when ``renormalize``, and rounded once to ``out_dtype``. Ids are
int64 in descending order of weight. Ties (equal probabilities, e.g. an all-zero padding row) go to the lower
expert id in the fused kernel; ``torch.topk`` leaves their order unspecified.
"""

from typing import Optional

import torch
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["router_topk", "router_topk_reference"]


def router_topk_reference(logits: Tensor, top_k: int, renormalize: bool,
                          out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Plain-torch router: ``(T, E)`` logits -> weights ``(T, k)`` in ``out_dtype`` and int64 ids ``(T, k)``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def router_topk(logits: Tensor, top_k: int, *, renormalize: bool = True, out_dtype: Optional[torch.dtype] = None,
                impl: str = "fused") -> tuple[Tensor, Tensor]:
    """Top-``top_k`` experts per token from router ``logits (T, E)`` (rows may be strided).

    Returns ``(weights, ids)``: ``weights (T, k)`` in ``out_dtype`` (default ``logits.dtype``), renormalised to sum
    to one when ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``), and int64 ``ids (T, k)``, highest weight first.

    Example:
        >>> w, ids = router_topk(torch.tensor([[0.0, 2.0, 1.0, -1.0]]), 2)
        >>> ids.tolist(), round(float(w.sum()), 6)
        ([[1, 2]], 1.0)
    """
    num_experts = logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}] (the number of experts)")
    out_dtype = logits.dtype if out_dtype is None else out_dtype
    path = kernel_path(impl, logits)
    if path == "torch":
        return router_topk_reference(logits, top_k, renormalize, out_dtype)
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (T, E) with a contiguous last dimension, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if path == "op":
        return torch.ops.bcg.router_topk(logits, top_k, renormalize, out_dtype)
    return _router_topk_triton(logits, top_k, renormalize, out_dtype)


# --- The op (bcg.ops.kernels.library): it allocates its results as its fake kernel does, then fills them. ---
def _router_topk_fake(logits: Tensor, top_k: int, renormalize: bool,
                      out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return (logits.new_empty((logits.shape[0], top_k), dtype=out_dtype),
            logits.new_empty((logits.shape[0], top_k), dtype=torch.int64))


def _router_topk_op(logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    weights, ids = _router_topk_fake(logits, top_k, renormalize, out_dtype)
    ref_weights, ref_ids = router_topk_reference(logits, top_k, renormalize, out_dtype)
    return weights.copy_(ref_weights), ids.copy_(ref_ids)


def _router_topk_triton(logits: Tensor, top_k: int, renormalize: bool,
                        out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from bcg.ops.kernels import triton_moe

    weights, ids = _router_topk_fake(logits, top_k, renormalize, out_dtype)
    triton_moe.router_topk(logits, renormalize, weights, ids)
    return weights, ids


kernel_op("router_topk", mutates_args=(), reference=_router_topk_op, triton=_router_topk_triton,
          fake=_router_topk_fake)
