"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) as the varlen island, where it imports: an optional backend.

FlashAttention 4 is written for Hopper and Blackwell (TMA, warp specialisation, the tensor cores' asynchronous MMA):
what issue 29 asks of attention at 2048 tokens and what bcg's Triton kernel, blocked as it is, does not reach. It
is a package of its own (``pip install flash-attn-4``, imported as ``flash_attn.cute``) that needs
``nvidia-cutlass-dsl``, whose libraries are about 240 MB unpacked, so bcg never requires it:
``attention_backend="flash4"`` refuses with the reason and the command where it does not import (the GPU machine
bcg is measured on cannot install it, so it has not been measured there).

It is the varlen island with FlashAttention 4's kernel in place of torch's FlashAttention 2: the same metadata, the
padded rows as one more sequence, the prefix gather; causal and bottom-right aligned, as FlashAttention's varlen
forward is. Layers with soft-caps, windows or sinks take the varlen backend's paths (bcg's Triton kernel). Its
kernels compile at the first call of each configuration (the runner's warmup, before any capture); the island runs
eagerly at replay, so FlashAttention 4's own host work is not captured.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch
from torch import Tensor

from bcg.ops.attention.base import AttentionBackend, BatchContext, register_attention_backend
from bcg.ops.attention.varlen import VarlenAttention
from bcg.ops.kv_cache import KVPool

__all__ = ["FLASH4_MODULE", "Flash4Attention", "flash4_kernel"]

FLASH4_MODULE = "flash_attn.cute"  # what `pip install flash-attn-4` provides
_HALF = (torch.float16, torch.bfloat16)
_INSTALL = "pip install flash-attn-4 (it needs nvidia-cutlass-dsl, about 240 MB)"


def _module() -> ModuleType:
    return importlib.import_module(FLASH4_MODULE)


def _importable() -> bool:
    try:
        return importlib.util.find_spec(FLASH4_MODULE) is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


def flash4_kernel(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                  max_seqlen_k: int, out: Tensor) -> None:
    """FlashAttention 4's varlen forward, causal, into ``out`` (a :data:`~bcg.ops.attention.varlen.VarlenKernel`).

    Its interface returns the output, or ``(output, lse)`` in some releases; either is written into ``out``.
    """
    result = _module().flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=True)
    out.copy_(result[0] if isinstance(result, tuple) else result)


@register_attention_backend
class Flash4Attention(VarlenAttention):
    """FlashAttention 4's varlen kernel as an eager island (``attention_backend="flash4"``; CUDA sm_90+, fp16/bf16,
    with ``flash-attn-4`` installed).

    Example::

        eng = Engine("llama-dense", attention_backend="flash4")   # where flash_attn.cute imports
    """

    name = "flash4"

    def __init__(self, kv_pool: KVPool) -> None:
        # Not torch's FlashAttention: none of its probes or copy notes (this kernel's output is copied into the
        # island's, one copy a layer, until its interface is called with an output of its own).
        AttentionBackend.__init__(self, kv_pool)

    @classmethod
    def is_usable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if not _importable():
            return f"flash-attn-4 is not installed ({FLASH4_MODULE} does not import): {_INSTALL}"
        if device.type != "cuda" or dtype not in _HALF:
            return (f"FlashAttention 4 runs on CUDA in float16/bfloat16 (got {device.type}, "
                    f"{str(dtype).removeprefix('torch.')})")
        if torch.cuda.get_device_capability(device)[0] < 9:
            return "FlashAttention 4 needs an sm_90 (Hopper) or newer GPU"
        return None

    def attend(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        self.attend_rows(ctx, q, k, v, out, layer_id, flash4_kernel)
