"""The breakable backend: one breakable graph per token bucket, attention as eager islands."""

from __future__ import annotations

from typing import Any

import bcg
from bcg.ops.bridge import BridgeBuffers, bridge_buffers
from bcg.runtime.backends.base import GraphBackend

__all__ = ["BreakableBackend"]


class BreakableBackend(GraphBackend):
    """Captures the layer stack per bucket with :func:`bcg.breakable_graph` into the runner's shared pool.

    In debug mode the whole layer stack is one eager break: the runner, static buffers and replay path stay the
    same while nothing of the model is captured, so a bug that disappears in debug mode is a capture bug.

    Island inputs and outputs go through one set of bridge buffers shared by every layer and bucket
    (:mod:`bcg.ops.bridge`), so the tensors each graph must keep alive do not add up over the ladder.
    """

    name = "breakable"

    def prepare(self) -> None:
        self.bridge = BridgeBuffers(self.resources.max_bucket)

    def capture(self, num_tokens: int) -> bcg.BreakableCUDAGraph:
        r = self.resources
        pool = r.pool.handle
        graph = bcg.BreakableCUDAGraph(pool=pool, emulate=r.is_emulated)
        layers = bcg.eager_on_graph(r.layers) if r.config.debug else r.layers
        with bridge_buffers(self.bridge), bcg.breakable_graph(graph, pool=pool, stream=r.capture_stream):
            out = layers(*r.inputs(num_tokens))
            r.static_output[:num_tokens].copy_(out)
        return graph

    def replay(self, handle: Any, num_tokens: int) -> None:
        handle.replay()

    def describe(self, handle: Any) -> tuple[int, int]:
        return (handle.num_segments, handle.num_breaks)
