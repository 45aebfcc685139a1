"""Mixture-of-experts model with Qwen3-MoE routing, computed with fixed shapes.

Routing: softmax over all experts (fp32), top-k, optional renormalisation of the k weights.
Experts run without any host read so the whole FFN can be captured: the ``T * k`` (token, expert)
pairs are sorted by expert on the device, group ends come from ``searchsorted`` on the sorted ids
(always ``E`` of them), and ``torch.nn.functional.grouped_mm`` multiplies each group by its
expert. Where ``grouped_mm`` does not run for the device/dtype/shape, an exact fallback gathers
each pair's expert matrix and uses ``bmm`` (memory ``T * k`` weight copies: fine for tests and
small batches, not for big GPU batches).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.models.config import ModelConfig
from bcg.models.dense import DenseLM
from bcg.models.parallel_layers import ShardSpec, even_part
from bcg.ops import kernels as fused
from bcg.ops.parallel import SINGLE, TensorParallel

logger = logging.getLogger(__name__)


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """Whether ``F.grouped_mm`` runs for this device, dtype and pair of expert dims.

    Probed once with a tiny call (kernels differ in dtype support and alignment rules across
    torch versions, so asking is the only reliable test). Call it before capture: the model does
    so in ``post_init``.
    """
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        mat_a = torch.zeros(2, hidden_size, device=device, dtype=dtype)
        mat_b = torch.zeros(2, 2 * intermediate_size, hidden_size, device=device, dtype=dtype)
        offs = torch.tensor([1, 2], device=device, dtype=torch.int32)
        F.grouped_mm(mat_a, mat_b.transpose(-2, -1), offs=offs)
        mat_a = torch.zeros(2, intermediate_size, device=device, dtype=dtype)
        mat_b = torch.zeros(2, hidden_size, intermediate_size, device=device, dtype=dtype)
        F.grouped_mm(mat_a, mat_b.transpose(-2, -1), offs=offs)
        is_supported = True
    except (RuntimeError, NotImplementedError) as exc:
        logger.info("grouped_mm unavailable for %s/%s (%s); MoE uses the gathered-bmm fallback", device, dtype, exc)
        is_supported = False
    return is_supported


@functools.cache
def grouped_mm_traceable(dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """Whether torch.compile can trace ``F.grouped_mm`` for this dtype (its meta kernel may accept fewer dtypes
    than the eager kernel: bf16 only in torch 2.13). Probed on the meta device, so it costs no memory."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        mat_a = torch.empty(2, hidden_size, device="meta", dtype=dtype)
        mat_b = torch.empty(2, 2 * intermediate_size, hidden_size, device="meta", dtype=dtype)
        offs = torch.empty(2, device="meta", dtype=torch.int32)
        F.grouped_mm(mat_a, mat_b.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class MoEFFN(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE semantics) with fixed shapes.

    Expert weights are stacked: ``experts_gate_up (E, 2I, H)`` and ``experts_down (E, H, I)``. Tensor parallel
    shards inside every expert (each rank ``I / tp.size`` of its gate, up and down features) and all-reduces the
    combined output once; the router is replicated, and every rank routes the same (replicated) hidden states.

    Example:
        >>> from bcg.models.config import get_preset
        >>> ffn = MoEFFN(get_preset("tiny-moe"))
        >>> ffn(torch.randn(5, 64)).shape
        torch.Size([5, 64])
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        num_experts, hidden = config.num_experts, config.hidden_size
        self.num_experts, self.top_k = num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.tp = tp
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        part = even_part(config.moe_intermediate_size, tp)
        inter = part.stop - part.start
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, inter))
        if tp.is_parallel:
            self.shard_specs = {"experts_gate_up": ShardSpec(1, (part, part)), "experts_down": ShardSpec(2, (part,))}
        self.use_grouped_mm = False
        self.grouped_mm_traceable = False

    kernels: str = "torch"

    def prepare(self) -> None:
        """Choose the expert kernel for the weights' device and dtype (host-side probe)."""
        weight = self.experts_gate_up
        hidden, inter = weight.shape[2], self.experts_down.shape[2]
        self.use_grouped_mm = grouped_mm_supported(weight.device, weight.dtype, hidden, inter)
        self.grouped_mm_traceable = self.use_grouped_mm and grouped_mm_traceable(weight.dtype, hidden, inter)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Router: ``(T, H)`` -> top-k weights ``(T, k)`` in ``x.dtype`` and expert ids ``(T, k)``."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights.to(x.dtype), topk_ids

    def _use_grouped_mm(self) -> bool:
        # Traced by torch.compile where grouped_mm has no meta kernel for the dtype: the (exact) bmm fallback.
        return self.use_grouped_mm and (self.grouped_mm_traceable or not torch.compiler.is_compiling())

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels == "fused":
            return self._forward_fused(x)
        num_rows, hidden = x.shape
        topk_weights, topk_ids = self.route(x)
        # Sort the T*k pairs by expert so each expert's rows are contiguous; stable keeps the
        # token order inside a group, which makes results independent of how the batch is packed.
        flat_ids = topk_ids.flatten()
        sorted_ids, order = flat_ids.sort(stable=True)
        x_sorted = x[order // self.top_k]
        if self._use_grouped_mm():
            experts = torch.arange(self.num_experts, device=x.device, dtype=sorted_ids.dtype)
            # offs[e] = end of expert e's group; always E entries, no host read.
            offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
            gate, up = F.grouped_mm(x_sorted, self.experts_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            y_sorted = F.grouped_mm(F.silu(gate) * up, self.experts_down.transpose(-2, -1), offs=offs)
        else:
            gate, up = torch.bmm(self.experts_gate_up[sorted_ids], x_sorted[:, :, None]).squeeze(-1).chunk(2, dim=-1)
            y_sorted = torch.bmm(self.experts_down[sorted_ids], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
        # Un-sort and sum the k expert outputs per token: a fixed-order reduction (unlike index_add_,
        # whose atomics make the sum order, and so the bits, vary between runs on GPU).
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        out = torch.einsum("tkh,tk->th", y.view(num_rows, self.top_k, hidden), topk_weights)
        return self.tp.all_reduce(out) if self.tp.is_parallel else out

    def _forward_fused(self, x: Tensor) -> Tensor:
        """The same layer on the fused kernels: router softmax/top-k in one kernel, the expert order (the stable
        sort and the group ends) in one, SiLU-and-multiply in one, and the un-sort with the weighted sum in one."""
        weights, ids = fused.router_topk(self.gate(x), self.top_k, renormalize=self.norm_topk_prob,
                                         out_dtype=x.dtype, impl="fused")
        order = fused.expert_order(ids, self.num_experts, impl="fused")
        x_sorted = x[order.token_index]
        if self._use_grouped_mm():
            gate_up = F.grouped_mm(x_sorted, self.experts_gate_up.transpose(-2, -1), offs=order.group_end)
            act = fused.silu_and_mul(gate_up, impl="fused")
            y_sorted = F.grouped_mm(act, self.experts_down.transpose(-2, -1), offs=order.group_end)
        else:
            gate_up = torch.bmm(self.experts_gate_up[order.expert], x_sorted[:, :, None]).squeeze(-1)
            act = fused.silu_and_mul(gate_up, impl="fused")
            y_sorted = torch.bmm(self.experts_down[order.expert], act[:, :, None]).squeeze(-1)
        out = fused.moe_combine(y_sorted, order.slot, weights, impl="fused")
        return self.tp.all_reduce(out) if self.tp.is_parallel else out


class MoELM(DenseLM):
    """Qwen3-MoE-style model (``arch="moe"``): dense attention, MoE FFN in every layer.

    Example:
        >>> from bcg.models.config import get_preset
        >>> type(MoELM(get_preset("tiny-moe")).layers[0].mlp).__name__
        'MoEFFN'
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp, make_mlp=MoEFFN)

    def post_init(self) -> None:
        super().post_init()
        prepare_experts(self)


def prepare_experts(model: nn.Module) -> None:
    """Pick the expert kernel of every :class:`MoEFFN` in ``model`` (call after moving it)."""
    for module in model.modules():
        if isinstance(module, MoEFFN):
            module.prepare()
