"""The whole-layer-stack graph's attention with bcg's Triton varlen kernel reading the KV pool in place.

:class:`~bcg.ops.attention.static.StaticAttention` (``"static"``) gathers every layer's keys and values from the
pool into a packed copy before FlashAttention varlen (two gathers per layer, and a fill of the padded rows after it).
``"static_triton"`` keeps the same fixed-size metadata (request slots, zero-length sentinels, the key capacity) and
hands the pool's layer with ``read_slots`` to :func:`bcg.ops.kernels.attention.varlen_attention`, which reads key
``j`` of request ``r`` at slot ``read_slots[cu_seqlens_k[r] + j]`` and zeroes the rows past the last request itself:
one kernel per layer. Inside a graph the kernel's Python launch cost is paid once, at capture.

A request whose slots run up by one (what a fresh pool hands out) is read by address instead, from its first slot
(``kv_base``, staged per request): the islands' loop, with no slot load for the key loads to wait on. Under
``kv_reads="runs"`` the kernel picks per request; ``"runs_only"`` compiles the address loop alone and sends batches
with a request in pieces to the islanded graphs. By default buckets up to :data:`RUNS_TOKENS` read ``"runs"`` (a
prefix-cache hit, whose cached slots and new ones are two runs, still replays the whole-step graph there) and the
larger ones ``"runs_only"`` (one key loop where attention weighs most).

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

__all__ = ["RUNS_TOKENS", "StaticTritonAttention"]

# The largest bucket whose kernel reads "runs" by default; larger ones read "runs_only". On the H200 (round 16,
# benchmarks/device_bound.py, whole-step graphs to 2048 tokens reading "runs_only" against the islanded graphs above
# 512/1024 tokens, two rounds each) device time was 0.98-1.02x on llama-dense, the Llama-3.2-1B and Qwen3-0.6B shapes
# at 1024 and 2048 tokens, the host's time 0.2-0.5x and the wall 0.95-1.01x; the "runs" kernel's second key loop
# costs it 1.18-1.28x at 1024-2048 tokens (round 15, benchmarks/attention_reads.py).
RUNS_TOKENS = 512

_HALF = (torch.float16, torch.bfloat16)


@register_attention_backend
class StaticTritonAttention(StaticAttention):
    """Attention captured inside the graph by bcg's Triton kernel over the pool's slots
    (``attention_backend="static_triton"``, for ``backend="full"``; CUDA with Triton, or the reference on a CPU).

    Args:
        kv_pool: the pool.
        max_requests: ``R``, the most requests one batch may pack.
        prefix_capacity: cached-prefix keys (summed over requests) a bucket attends to on top of its own rows.
        kv_reads: how the kernel reads a request's keys in every bucket: ``"runs"`` by address where its slots run
            up by one, else through them; ``"slots"`` every key through its slot; ``"runs_only"`` by address only (a
            batch with a request whose slots do not run up by one does not fit: reason ``slots_not_in_runs``).
            None: ``BCG_KV_READS`` (:mod:`bcg.env`) where set, else by bucket: ``"runs"`` up to
            :data:`RUNS_TOKENS`, ``"runs_only"`` above (:meth:`reads`).

    Example::

        eng = Engine("llama-dense", backend="full", attention_backend="static_triton")                    # CUDA
        eng = Engine("tiny-dense", backend="full", device="cpu", dtype="bfloat16", attention_backend="static_triton")
    """

    name = "static_triton"
    use_slot_kernel = True

    def __init__(self, kv_pool: KVPool, max_requests: int = 4, prefix_capacity: int = 0,
                 kv_reads: str | None = None) -> None:
        # use_varlen=False: no FlashAttention probe (this kernel is bottom-right by construction and never calls it).
        super().__init__(kv_pool, max_requests, prefix_capacity, use_varlen=False)
        kv_reads = env.KV_READS if kv_reads is None else kv_reads
        if kv_reads not in (None, "slots", "runs", "runs_only"):
            raise ValueError(f"kv_reads={kv_reads!r}: expected 'slots', 'runs', 'runs_only' or None (by bucket)")
        self.kv_reads = kv_reads  # None: by bucket

    def reads(self, bucket: int) -> str:
        """How bucket ``bucket``'s kernel reads keys (``kv_reads`` where given, else by bucket size).

        Example::

            attn = StaticTritonAttention(pool)            # BCG_KV_READS unset
            attn.reads(512), attn.reads(1024)             # ('runs', 'runs_only')
        """
        if self.kv_reads is not None:
            return self.kv_reads
        return "runs" if bucket <= RUNS_TOKENS else "runs_only"

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
