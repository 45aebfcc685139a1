"""Attention: the call models make, and the backends that compute it, each owning the metadata it reads.

* :func:`attention` (:mod:`.island`): the K/V write in the graph segment, then the kernel, as an island or captured.
* :mod:`.base`: :class:`AttentionBackend` (the hooks the runner calls: ``fields``, ``stage``, ``context``), the live
  :class:`BatchContext`, and the registry of backends by name.
* ``"varlen"`` (:mod:`.varlen`): FlashAttention varlen as an island, the default on CUDA in half precision (on a
  CPU, when asked for, FlashAttention's reference in plain torch: :mod:`bcg.ops.flash_reference`).
* ``"sdpa"`` (:mod:`.sdpa`): per-request SDPA as an island, the exact reference and the default elsewhere.
* ``"triton"`` (:mod:`.triton_varlen`): bcg's Triton varlen kernel as the same island, written in place, with
  soft-caps, windows and sinks (the varlen backend uses it for soft-capped layers on CUDA).
* ``"flash4"`` (:mod:`.flash4`): FlashAttention 4 (``flash-attn-4``, CuTe DSL) as the same island, optional: only
  where that package imports (CUDA sm_90+).
* ``"static"`` (:mod:`.static`): captured inside the graph over request slots and a key capacity (``full``'s).
* ``"static_triton"`` (:mod:`.static_triton`): the same, bcg's Triton kernel reading the pool through the slots (no
  gather; opt-in).
* :mod:`.features`: sliding windows, sinks, soft-caps and scales, the path of the layers that have them.

A new attention kernel is a new file here with a class registered by :func:`register_attention_backend`.
"""

from types import SimpleNamespace

import numpy as np
import torch

from bcg.ops.attention import flash4, sdpa, static, static_triton, triton_varlen, varlen  # noqa: F401 - each registers one
from bcg.ops.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    BatchContext,
    HostBatch,
    attention_backend,
    register_attention_backend,
)
from bcg.ops.attention.island import attention, attention_island, kv_destination
from bcg.ops.attention.sdpa import SdpaAttention, sdpa_attention
from bcg.ops.attention.static import StaticAttention, StaticContext
from bcg.ops.attention.static_triton import StaticTritonAttention
from bcg.ops.attention.triton_varlen import TritonAttention
from bcg.ops.attention.varlen import VarlenAttention
from bcg.ops.context import AttentionFeatures
from bcg.ops.kv_cache import KVPool
from bcg.ops.staging import Layout, Staged

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionFeatures", "BatchContext", "HostBatch",
           "SdpaAttention", "StaticAttention", "StaticContext", "StaticTritonAttention", "TritonAttention",
           "VarlenAttention", "attention", "attention_backend", "attention_island", "default_attention_backend",
           "kv_destination", "register_attention_backend", "sdpa_attention", "single_request_context"]


def default_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The live backend for ``device``/``dtype``: "varlen" where the FlashAttention kernel runs (CUDA), else "sdpa"
    (the CPU runs "varlen" only when asked for: its reference is for tests, not speed)."""
    return "varlen" if device.type == "cuda" and VarlenAttention.is_usable(device, dtype) is None else "sdpa"


def single_request_context(num_tokens: int, kv_pool: KVPool, dtype: torch.dtype) -> BatchContext:
    """The live context of one request of ``num_tokens`` new tokens in slots ``0..num_tokens-1`` of ``kv_pool``,
    through the default backend (for probe forwards of a model, outside any runner).

    Example:
        >>> pool = KVPool(8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> single_request_context(3, pool, torch.float32).cu_seqlens_q.tolist()
        [0, 3]
    """
    backend = attention_backend(default_attention_backend(kv_pool.device, dtype))(kv_pool)
    cu = np.array([0, num_tokens], dtype=np.int64)
    slots = np.arange(num_tokens, dtype=np.int64)
    batch = SimpleNamespace(num_tokens=num_tokens, num_requests=1, seq_lens_q=[num_tokens], prefix_lens=[0],
                            has_prefix=False, max_seqlen_q=num_tokens, max_seqlen_k=num_tokens, host_cu_seqlens_q=cu,
                            host_cu_seqlens_k=cu, host_write_slots=slots, host_read_slots=slots,
                            host_run_starts=cu[:1])
    staged = Staged(Layout(*backend.fields(num_tokens)), backend.tail_lengths(batch), kv_pool.device)
    backend.stage(batch, num_tokens, staged)
    return backend.context(batch, num_tokens, staged.upload())
