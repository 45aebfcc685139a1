"""The full backend: one plain CUDA graph per token bucket holding the whole layer stack, attention included."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bcg.runtime.backends.base import GraphBackend
from bcg.runtime.backends.capture import capturing, hold_pool, new_graph
from bcg.runtime.static_attention import static_varlen_usable
from bcg.runtime.static_context import StaticForwardContext, StaticMetadata

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch

__all__ = ["FullBackend"]


class FullBackend(GraphBackend):
    """Captures ``forward_layers`` per bucket with no break: the attention island runs inside the graph.

    It can, because under a :class:`StaticForwardContext` the island takes a fixed-shape path whose metadata
    (cumulative lengths, KV write/read slots, per-row and per-key request ids and positions) lives in static
    buffers sized for ``config.request_slots`` requests and a key capacity of ``bucket + config.prefix_keys``.
    ``load_batch`` rewrites those buffers for every replay; a batch that does not fit (more requests than slots,
    more keys than the capacity) runs eagerly with the reason recorded. Models whose islands cannot be captured
    (DSA) are refused with the op named, and the engine serves them eagerly.

    Example::

        eng = Engine("tiny-dense", backend="full", device="cpu", buckets=[8, 16], max_requests=4)
        eng.prefill([[1, 2, 3], [4, 5]]).batches[0].graph_used     # True: one graph launch per forward
    """

    name = "full"

    def prepare(self) -> None:
        r = self.runner
        use_varlen = not r.emulate and static_varlen_usable(r.device, r.dtype)
        self.metadata = StaticMetadata(r.kv_pool, r.table.sizes, r.config.request_slots, r.config.prefix_keys,
                                       r.static_positions, use_varlen)
        self._anchor = hold_pool(r.pool, r.capture_stream)

    def can_run(self, batch: PrefillBatch, bucket: int) -> str | None:
        return self.metadata.check(batch, bucket)

    def load_batch(self, batch: PrefillBatch, bucket: int) -> StaticForwardContext:
        return self.metadata.load(batch, bucket)

    def capture(self, num_tokens: int) -> Any:
        r = self.runner
        graph = new_graph(r.emulate)
        with capturing(graph, r.pool, r.capture_stream):
            out = r.model.forward_layers(r.static_hidden[:num_tokens], r.static_positions[:num_tokens])
            r.static_output[:num_tokens].copy_(out)
        return graph

    def replay(self, handle: Any, num_tokens: int) -> None:
        handle.replay()
