"""The whole-layer-stack graph's attention with bcg's Triton varlen kernel reading the KV pool in place.

:class:`~bcg.ops.attention.static.StaticAttention` (``"static"``) gathers every layer's keys and values from the
pool into a packed copy before FlashAttention varlen (two gathers per layer, and a fill of the padded rows after it).
``"static_triton"`` keeps the same fixed-size metadata (request slots, zero-length sentinels, the key capacity) and
hands the pool's layer with ``read_slots`` to :func:`bcg.ops.kernels.attention.varlen_attention`, which reads key
``j`` of request ``r`` at slot ``read_slots[cu_seqlens_k[r] + j]`` and zeroes the rows past the last request itself:
one kernel per layer. Inside a graph the kernel's Python launch cost is paid once, at capture.

It is what the whole-step graphs of a breakable engine attend with wherever it runs (``full_graph_tokens``, on by
default on one GPU); backend ``full`` alone asks for it by name. It masks by ``cu_seqlens`` alone, so a batch stages
only the slots and cumulative lengths. On a CPU it runs the kernel's reference (half precision, as the kernel), so its
host logic runs in CI.
"""

from __future__ import annotations

import torch

from bcg import env
from bcg.ops.attention.base import register_attention_backend
from bcg.ops.attention.static import StaticAttention
from bcg.ops.kernels.dispatch import fused_available
from bcg.ops.kv_cache import KVPool

__all__ = ["StaticTritonAttention"]

_HALF = (torch.float16, torch.bfloat16)


@register_attention_backend
class StaticTritonAttention(StaticAttention):
    """Attention captured inside the graph by bcg's Triton kernel over the pool's slots
    (``attention_backend="static_triton"``, for ``backend="full"``; CUDA with Triton, or the reference on a CPU).

    Args:
        kv_pool: the pool.
        max_requests: ``R``, the most requests one batch may pack.
        prefix_capacity: cached-prefix keys (summed over requests) a bucket attends to on top of its own rows.
        stages_kv_base: also stage each request's first slot where its slots run up by one, so the kernel reads
            those keys by address (None: ``BCG_SLOT_BASE``, :mod:`bcg.env`).

    Example::

        eng = Engine("llama-dense", backend="full", attention_backend="static_triton")                    # CUDA
        eng = Engine("tiny-dense", backend="full", device="cpu", dtype="bfloat16", attention_backend="static_triton")
    """

    name = "static_triton"
    use_slot_kernel = True

    def __init__(self, kv_pool: KVPool, max_requests: int = 4, prefix_capacity: int = 0,
                 stages_kv_base: bool | None = None) -> None:
        # use_varlen=False: no FlashAttention probe (this kernel is bottom-right by construction and never calls it).
        super().__init__(kv_pool, max_requests, prefix_capacity, use_varlen=False)
        # Each request's first slot where its slots run up by one, for the kernel to read those keys by address
        # (None: the BCG_SLOT_BASE switch, off until measured on a GPU).
        self.stages_kv_base = env.SLOT_BASE if stages_kv_base is None else stages_kv_base

    @classmethod
    def is_usable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype not in _HALF:
            return (f"the Triton varlen kernel takes float16/bfloat16 (got {str(dtype).removeprefix('torch.')}); "
                    "use attention_backend='static' for other dtypes")
        if device.type == "cuda" and not fused_available(device):
            return "the Triton varlen kernel needs triton importable on CUDA (install the triton matching torch)"
        if device.type not in ("cuda", "cpu"):
            return f"the Triton varlen kernel runs on CUDA (or its reference on the CPU), not {device.type}"
        return None
