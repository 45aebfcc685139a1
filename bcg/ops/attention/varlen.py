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
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from bcg.ops.attention.base import AttentionBackend, BatchContext, register_attention_backend
from bcg.ops.attention.sdpa import sdpa_attention
from bcg.ops.flash import copy_reason, flash_varlen, runs_flash_varlen, varlen_causal_is_bottom_right
from bcg.ops.kv_cache import KVPool

__all__ = ["VarlenAttention"]

logger = logging.getLogger(__name__)


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
        if not ctx.has_prefix:  # the common case: one kernel over every row, the padded ones as a sequence of their own
            flash_varlen(q, k, v, ctx.padded_cu_seqlens, ctx.padded_cu_seqlens, ctx.padded_max_seqlen,
                         ctx.padded_max_seqlen, is_causal=True, out=out)
            return
        n = ctx.num_tokens
        keys, values = ctx.keys_values(layer_id, k, v)
        if varlen_causal_is_bottom_right(q.device):
            flash_varlen(q[:n], keys, values, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                         is_causal=True, out=out[:n])
        else:
            out[:n].copy_(sdpa_attention(q[:n], keys, values, ctx))
        if n < ctx.num_padded_tokens:
            out[n:].zero_()


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)
