"""The varlen island: FlashAttention's variable-length forward over every request of the live batch at once.

CUDA, fp16/bf16; on a CPU, in fp16/bf16 too, through FlashAttention's reference in plain torch
(:mod:`bcg.ops.flash_reference`, which refuses what the kernel refuses), so every path below runs in CI. The island
launches one kernel and nothing else when no request has a cached prefix: the K/V were written in the graph segment
before it (:meth:`~bcg.ops.attention.base.BatchContext.store_kv`), the padded rows run as one more sequence of their
own (so every output row is written and finite, and no zeroing is needed; when the batch fills its bucket that
sequence is empty), and the kernel writes straight into the island's output where the torch build has an in-place
route (else one copy follows it, :func:`~bcg.ops.flash.copy_reason`, logged once and kept in :attr:`notes`). A batch
with a prefix gathers its key ranges from the pool first. The causal mask must be aligned bottom-right when a
request has a prefix (query ``i`` sees keys ``0..prefix+i``): that is probed once per device, and a top-left kernel
sends those batches to the reference.

Buckets of :data:`TRITON_FROM_TOKENS` tokens or more (:data:`TRITON_FROM_TOKENS_WIDE` for wide attention,
:func:`triton_from_tokens`) run bcg's Triton varlen kernel on CUDA (faster there on the H200, and in place; its
launch costs more host time, which short prompts pay). Soft-capped layers (gemma2) and layers with
sinks (gpt-oss) run it too
(:mod:`bcg.ops.kernels.attention`: torch's FlashAttention has no soft-cap, and its sinks take three more launches),
over the same metadata; without Triton, and on a CPU, they take the feature path's
exact per-request math. :class:`~bcg.ops.attention.triton_varlen.TritonAttention` runs that kernel for every layer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from bcg import env
from bcg.ops.attention.base import AttentionBackend, BatchContext, register_attention_backend
from bcg.ops.attention.sdpa import sdpa_attention
from bcg.ops.context import AttentionFeatures
from bcg.ops.flash import copy_reason, flash_varlen, runs_flash_varlen, varlen_causal_is_bottom_right
from bcg.ops.kernels.attention import varlen_attention
from bcg.ops.kernels.dispatch import fused_available
from bcg.ops.kv_cache import KVPool

__all__ = ["VarlenAttention", "VarlenKernel", "flash_kernel", "triton_kernel"]

# A varlen kernel as the islands call it: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out),
# causal and bottom-right aligned, written into out.
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, Tensor], object]


def flash_kernel(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, out: Tensor) -> None:
    """FlashAttention varlen (:func:`~bcg.ops.flash.flash_varlen`), causal, into ``out``."""
    flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=True, out=out)


def triton_kernel(features: AttentionFeatures | None = None) -> VarlenKernel:
    """bcg's varlen kernel (:func:`~bcg.ops.kernels.attention.varlen_attention`: Triton on CUDA, the reference
    elsewhere) with ``features`` (a window ``W`` is a left window of ``W - 1``)."""
    if features is None:
        return varlen_attention
    window_left = None if features.window is None else features.window - 1
    return functools.partial(varlen_attention, scale=features.scale, softcap=features.softcap,
                             window_left=window_left, sinks=features.sinks)


def triton_from_tokens(q: Tensor) -> int:
    """The bucket from which the island runs bcg's Triton kernel for queries ``q (tokens, heads, head_dim)``:
    :data:`TRITON_FROM_TOKENS_WIDE` for attention at least :data:`WIDE_ATTENTION` wide, else
    :data:`TRITON_FROM_TOKENS`."""
    return TRITON_FROM_TOKENS_WIDE if q.shape[-2] * q.shape[-1] >= WIDE_ATTENTION else TRITON_FROM_TOKENS


def runs_triton_varlen(q: Tensor, v: Tensor) -> bool:
    """Whether the Triton varlen kernel takes these layers on their device: CUDA with Triton, equal head dims."""
    return q.is_cuda and v.shape[-1] == q.shape[-1] and fused_available(q.device)

logger = logging.getLogger(__name__)

# Buckets from which the island runs bcg's Triton varlen kernel where it can, FlashAttention below. Its launch costs
# the host more than FlashAttention's (56-86 us a layer in a prefill, round 8), and a short prompt's islands are on
# the critical path (at 64 tokens: 2.2x the wall time), so it waits for buckets where it saves more device time than
# that. On the H200 (round 13, benchmarks/device_bound.py, the island from 512 tokens against from 2048, 1024-token
# prompts): attention 2048 wide (q heads x head dim) gained most, the Qwen3-0.6B shape 0.72x the wall (FlashAttention
# takes 65 us a layer at head dim 128, bcg's kernel 24) and the Llama-3.2-1B shape 0.93x; llama-dense (1024 wide,
# 28 thin layers) lost, 1.13x, its host the bottleneck. So wide attention takes the kernel from 1024 tokens, narrow
# from 2048. BCG_TRITON_VARLEN_FROM sets one threshold for every width (a debug switch, for measuring).
TRITON_FROM_TOKENS = env.TRITON_VARLEN_FROM or 2048
TRITON_FROM_TOKENS_WIDE = env.TRITON_VARLEN_FROM or 1024
WIDE_ATTENTION = 2048  # q heads x head dim from which attention counts as wide
# Logged once each; constants, so an island's call at every layer formats nothing (the log's cache sees one string).
_TRITON_BUCKETS_NOTE = (f"bcg varlen attention: buckets of {TRITON_FROM_TOKENS} tokens or more "
                        f"({TRITON_FROM_TOKENS_WIDE} where q heads x head dim >= {WIDE_ATTENTION}) run bcg's Triton "
                        "varlen kernel (faster there, and in place)")
_TRITON_FEATURES_NOTE = ("bcg varlen attention: soft-capped layers and layers with sinks run bcg's Triton varlen "
                         "kernel (torch's FlashAttention has neither)")


@register_attention_backend
class VarlenAttention(AttentionBackend):
    """FlashAttention varlen as an eager island (``attention_backend="varlen"``, the default on CUDA in half
    precision; on a CPU it runs FlashAttention's reference, in half precision as the kernel).

    Attributes:
        notes: the copy after each kernel where the torch build has no in-place route (logged once as well).

    Example::

        eng = Engine("llama-dense", attention_backend="varlen")     # CUDA, bf16
        eng = Engine("tiny-dense", device="cpu", dtype="bfloat16", attention_backend="varlen")   # the reference
    """

    name = "varlen"
    is_island = True
    features_flash = True

    def __init__(self, kv_pool: KVPool) -> None:
        super().__init__(kv_pool)
        device = kv_pool.device
        if device.type == "cuda":
            # The once-per-device probes (the direct aten call, the causal alignment) read results back to the
            # host: they run here, before any capture or replay, never inside an island.
            varlen_causal_is_bottom_right(device)
        reason = copy_reason(device)
        if reason is not None:
            _log_once(f"bcg varlen attention on {device}: {reason}")
            self.notes.append(f"varlen attention: {reason}")

    @classmethod
    def is_usable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if not runs_flash_varlen(device, dtype):
            return (f"FlashAttention varlen needs float16/bfloat16, on CUDA with a torch that has varlen_attn or on "
                    f"the CPU (its reference) (got {device.type}, {str(dtype).removeprefix('torch.')})")
        return None

    def attend(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        if ctx.num_padded_tokens >= triton_from_tokens(q) and runs_triton_varlen(q, v):
            _log_once(_TRITON_BUCKETS_NOTE, logging.INFO)
            self.attend_rows(ctx, q, k, v, out, layer_id, triton_kernel())
            return
        self.attend_rows(ctx, q, k, v, out, layer_id, flash_kernel)

    def attend_with(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    features: AttentionFeatures) -> None:
        # Soft-caps and sinks: bcg's kernel takes them in its one launch, where FlashAttention has no soft-cap and
        # its sinks cost a log-sum-exp, a gate and a multiply after it (and an exact reference without Triton).
        if (features.softcap is not None or features.sinks is not None) and runs_triton_varlen(q, v):
            _log_once(_TRITON_FEATURES_NOTE, logging.INFO)
            self.attend_rows(ctx, q, k, v, out, layer_id, triton_kernel(features))
            return
        super().attend_with(ctx, q, k, v, out, layer_id, features)

    def attend_rows(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    kernel: VarlenKernel) -> None:
        """``kernel`` over the live batch into ``out``: one call over every row (the padded ones as a sequence of
        their own) when nothing is cached, else over the real rows and each request's gathered key range (then the
        padded rows are zeroed)."""
        if not ctx.has_prefix:  # the common case: one kernel over every row, the padded ones as a sequence of their own
            kernel(q, k, v, ctx.padded_cu_seqlens, ctx.padded_cu_seqlens, ctx.padded_max_seqlen,
                   ctx.padded_max_seqlen, out)
            return
        n = ctx.num_tokens
        keys, values = ctx.keys_values(layer_id, k, v)
        if kernel is not flash_kernel or varlen_causal_is_bottom_right(q.device):  # bcg's kernel is bottom-right
            kernel(q[:n], keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                   out[:n])
        else:
            out[:n].copy_(sdpa_attention(q[:n], keys, values, ctx))
        if n < ctx.num_padded_tokens:
            out[n:].zero_()


@functools.cache
def _log_once(message: str, level: int = logging.WARNING) -> None:
    logger.log(level, message)
