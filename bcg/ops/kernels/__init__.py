"""Fused kernels for the models' non-matmul ops: Triton on CUDA, a plain-torch reference everywhere else.

Inside a CUDA graph each kernel costs about a microsecond of device time even when it is tiny, so the ops between
matmuls are fused: RMSNorm and in-place residual add + RMSNorm, SiLU-and-multiply and gpt-oss's clamped SwiGLU,
SiLU-and-multiply inside the gate/up or the down projection at short prompts (measured, chosen by ``BCG_MLP_FUSION``),
the down projection's split-K partials summed by the next add + RMSNorm (no reduce kernel), the qkv split with q/k
norm and RoPE written straight into the attention island's inputs (inside the q/k/v projection's epilogue at short
prompts), the MoE router (softmax or sigmoid scores, top-k, the weights), and the token permutation around the
experts. Each entry point takes ``impl="fused" | "torch"`` (default ``"fused"``; the models pass their own setting);
``"fused"`` runs Triton for CUDA tensors and the reference on any other device.
The kernels are capturable (no host reads, no allocation of data-dependent size; Triton
compiles a kernel at its first call, so warm up before capturing) and registered as ``torch.ops.bcg.*`` custom
ops (:mod:`bcg.ops.kernels.library`), which is what ``torch.compile`` traces when the fused path is on, on any
device.

Example:
    >>> import torch
    >>> from bcg.ops import kernels
    >>> x, h = torch.randn(4, 64), torch.randn(4, 64)
    >>> n, h = kernels.fused_add_rms_norm(x, h, torch.ones(64), 1e-6)   # h += x; n = rms_norm(h), in place
    >>> kernels.silu_and_mul(torch.randn(4, 256)).shape
    torch.Size([4, 128])
"""

from bcg.ops.kernels.activation import (
    clamped_swiglu,
    clamped_swiglu_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from bcg.ops.kernels.dispatch import KernelImpl, fused_available
from bcg.ops.kernels.down_partials import down_partials, num_splits
from bcg.ops.kernels.down_proj import swiglu_down, swiglu_down_reference
from bcg.ops.kernels.gate_up import gate_up_silu
from bcg.ops.kernels.moe_permute import (
    ExpertOrder,
    expert_order,
    expert_order_reference,
    moe_combine,
    moe_combine_reference,
)
from bcg.ops.kernels.moe_router import router_topk, router_topk_reference
from bcg.ops.kernels.norm import (
    add_partials,
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from bcg.ops.kernels.qkv_rope import qkv_proj_rope
from bcg.ops.kernels.rope import qkv_norm_rope, qkv_norm_rope_reference

__all__ = [
    "ExpertOrder", "KernelImpl", "add_partials", "clamped_swiglu", "clamped_swiglu_reference", "down_partials",
    "expert_order", "expert_order_reference", "fused_add_rms_norm", "fused_add_rms_norm_reference", "fused_available",
    "gate_up_silu", "moe_combine", "moe_combine_reference", "num_splits", "qkv_norm_rope", "qkv_norm_rope_reference",
    "qkv_proj_rope", "rms_norm", "rms_norm_reference", "router_topk", "router_topk_reference", "silu_and_mul",
    "silu_and_mul_reference", "swiglu_down", "swiglu_down_reference",
]
