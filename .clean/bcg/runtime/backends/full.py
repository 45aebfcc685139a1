"""The full backend: one plain CUDA graph per token bucket holding the whole step, attention included."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bcg.ops.attention import AttentionBackend, StaticAttention, attention_backend
from bcg.ops.kv_cache import KVPool
from bcg.runtime.backends.base import GraphBackend
from bcg.runtime.backends.capture import capturing, new_graph

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch
    from bcg.runtime.config import EngineConfig

__all__ = ["FullBackend"]


class FullBackend(GraphBackend):
    """Captures each bucket's step with no break: the attention runs inside the graph.

    It can, because its attention backend is :class:`~bcg.ops.attention.static.StaticAttention`, whose fixed-shape
    path reads metadata (cumulative lengths, KV write/read slots, per-row and per-key request ids and positions)
    from fields sized for ``config.max_requests`` request slots and a key capacity of ``bucket +
    config.prefix_capacity``. The runner rewrites those fields for every replay; a batch that does not fit (more
    requests than slots, more keys than the capacity) runs eagerly with the reason recorded. Models whose islands
    cannot be captured (DSA) are refused with the op named, and the engine serves them eagerly.

    Example::

        eng = Engine("tiny-dense", backend="full", device="cpu", buckets=[8, 16], max_requests=4)
        eng.prefill([[1, 2, 3], [4, 5]]).batches[0].graph_used     # True: one graph launch per forward
    """

    name = "full"

    @classmethod
    def default_attention(cls, device: torch.device, dtype: torch.dtype) -> str:
        return StaticAttention.name  # attends inside the graph, whatever the device

    @classmethod
    def make_attention(cls, kv_pool: KVPool, config: EngineConfig, device: torch.device,
                       dtype: torch.dtype) -> AttentionBackend:
        cls_ = attention_backend(config.attention_backend or StaticAttention.name)
        if not issubclass(cls_, StaticAttention):
            raise ValueError(f"backend='full' captures its attention inside the graph with attention_backend="
                             f"'static' or 'static_triton'; attention_backend={config.attention_backend!r} attends "
                             "in islands, which backend='breakable' runs")
        reason = cls_.is_usable(device, dtype)
        if reason is not None:
            raise ValueError(f"attention_backend={cls_.name!r} cannot run here: {reason}")
        chunk = config.chunked_prefill_size
        # Defaults: one slot per 512 tokens of a chunk, and a whole chunk of cached prefix keys.
        max_requests = config.max_requests or max(chunk // 512, 1)
        prefix_capacity = config.prefix_capacity if config.prefix_capacity is not None else chunk
        # "static": FlashAttention varlen inside the graph where it probes right; "static_triton": bcg's kernel.
        return cls_(kv_pool, max_requests, prefix_capacity)

    def can_run(self, batch: PrefillBatch, bucket: int) -> str | None:
        return self.resources.inputs.attention.check(batch, bucket)

    def capture(self, num_tokens: int) -> Any:
        r = self.resources
        graph = new_graph(r.is_emulated)
        with capturing(graph, r.pool.handle, r.capture_stream):
            r.run(num_tokens)
        return graph

    def replay(self, handle: Any, num_tokens: int) -> None:
        handle.replay()
