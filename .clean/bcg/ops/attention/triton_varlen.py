"""The Triton varlen island: bcg's own varlen attention kernel over the live batch, for every layer.

The same island as :class:`~bcg.ops.attention.varlen.VarlenAttention` (its metadata, its padded-rows sequence, its
prefix gather) with bcg's kernel (:func:`bcg.ops.kernels.attention.varlen_attention`) in place of FlashAttention's:
it writes the island's output in place on every torch build (torch 2.11's FlashAttention returns a new tensor that
is copied), it is bottom-right aligned by construction (no probe), and windows, soft-caps, sinks and scales are
switches of the one kernel, so every layer with equal head dims attends in one launch. On a CPU it runs the
kernel's reference (in half precision, as the kernel), so the island's host logic runs in CI.

Not the default backend: the varlen backend already sends its large buckets (2048 tokens or more, 1024 where
attention is 2048 wide: :func:`~bcg.ops.attention.varlen.triton_from_tokens`) and soft-capped layers to the same
kernel on CUDA; ``benchmarks/attention_kernels.py`` measures it against FlashAttention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bcg.ops.attention.base import AttentionBackend, BatchContext, register_attention_backend
from bcg.ops.attention.varlen import VarlenAttention, triton_kernel
from bcg.ops.context import AttentionFeatures
from bcg.ops.kernels.dispatch import fused_available
from bcg.ops.kv_cache import KVPool

__all__ = ["TritonAttention"]

_HALF = (torch.float16, torch.bfloat16)


@register_attention_backend
class TritonAttention(VarlenAttention):
    """bcg's Triton varlen kernel as an eager island (``attention_backend="triton"``; CUDA with Triton, or the
    kernel's reference on a CPU; fp16/bf16).

    Example::

        eng = Engine("llama-dense", attention_backend="triton")                                   # CUDA, bf16
        eng = Engine("tiny-dense", device="cpu", dtype="bfloat16", attention_backend="triton")   # the reference
    """

    name = "triton"
    features_flash = False  # layers this kernel cannot take (V's head dim differs) get the exact reference

    def __init__(self, kv_pool: KVPool) -> None:
        # FlashAttention's probes and copy note are not this kernel's: it writes in place and is bottom-right.
        AttentionBackend.__init__(self, kv_pool)

    @classmethod
    def is_usable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype not in _HALF:
            return f"the Triton varlen kernel takes float16/bfloat16 (got {str(dtype).removeprefix('torch.')})"
        if device.type == "cuda" and not fused_available(device):
            return "the Triton varlen kernel needs triton importable on CUDA (install the triton matching torch)"
        if device.type not in ("cuda", "cpu"):
            return f"the Triton varlen kernel runs on CUDA (or its reference on the CPU), not {device.type}"
        return None

    def attend(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        self.attend_rows(ctx, q, k, v, out, layer_id, triton_kernel())

    def attend_with(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    features: AttentionFeatures) -> None:
        if v.shape[-1] != q.shape[-1]:  # the kernel has one head dim: the feature path's exact math
            AttentionBackend.attend_with(self, ctx, q, k, v, out, layer_id, features)
            return
        self.attend_rows(ctx, q, k, v, out, layer_id, triton_kernel(features))
