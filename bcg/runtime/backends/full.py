"""The full backend: one plain CUDA graph per token bucket holding the whole layer stack, attention included."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bcg.ops.static_attention import StaticContext, static_varlen_usable
from bcg.runtime.backends.base import GraphBackend
from bcg.runtime.backends.capture import capturing, new_graph
from bcg.runtime.backends.static_metadata import StaticMetadata

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch

__all__ = ["FullBackend"]


class FullBackend(GraphBackend):
    """Captures ``forward_layers`` per bucket with no break: the attention island runs inside the graph.

    It can, because under a :class:`~bcg.ops.static_attention.StaticContext` the island takes a fixed-shape path
    whose metadata (cumulative lengths, KV write/read slots, per-row and per-key request ids and positions) lives in
    static buffers sized for ``config.max_requests`` request slots and a key capacity of
    ``bucket + config.prefix_capacity``.
    ``load_batch`` rewrites those buffers for every replay; a batch that does not fit (more requests than slots,
    more keys than the capacity) runs eagerly with the reason recorded. Models whose islands cannot be captured
    (DSA) are refused with the op named, and the engine serves them eagerly.

    Example::

        eng = Engine("tiny-dense", backend="full", device="cpu", buckets=[8, 16], max_requests=4)
        eng.prefill([[1, 2, 3], [4, 5]]).batches[0].graph_used     # True: one graph launch per forward
    """

    name = "full"

    def prepare(self) -> None:
        r = self.resources
        use_varlen = not r.is_emulated and static_varlen_usable(r.static_hidden.device, r.static_hidden.dtype)
        chunk = r.config.chunked_prefill_size
        # Defaults: one slot per 512 tokens of a chunk, and a whole chunk of cached prefix keys.
        max_requests = r.config.max_requests or max(chunk // 512, 1)
        prefix_capacity = r.config.prefix_capacity if r.config.prefix_capacity is not None else chunk
        self.metadata = StaticMetadata(r.kv_pool, r.bucket_sizes, max_requests, prefix_capacity,
                                       r.static_positions, use_varlen)

    def can_run(self, batch: PrefillBatch, bucket: int) -> str | None:
        return self.metadata.check(batch, bucket)

    def load_batch(self, batch: PrefillBatch, bucket: int) -> StaticContext:
        return self.metadata.load(batch, bucket)

    def capture(self, num_tokens: int) -> Any:
        r = self.resources
        graph = new_graph(r.is_emulated)
        with capturing(graph, r.pool.handle, r.capture_stream):
            out = r.layers(*r.inputs(num_tokens))
            r.static_output[:num_tokens].copy_(out)
        return graph

    def replay(self, handle: Any, num_tokens: int) -> None:
        handle.replay()
