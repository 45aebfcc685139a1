"""The breakable backend: one breakable graph per token bucket, attention as eager islands."""

from __future__ import annotations

from typing import Any

import bcg
from bcg.ops.bridge import BridgeBuffers, bridge_buffers
from bcg.runtime.backends.base import GraphBackend

__all__ = ["BreakableBackend"]


class BreakableBackend(GraphBackend):
    """Captures each bucket's step with :func:`bcg.breakable_graph` into the runner's shared pool.

    In debug mode the whole step is one eager break: the runner, static buffers and replay path stay the same while
    nothing of the model is captured, so a bug that disappears in debug mode is a capture bug.

    Island inputs and outputs go through one set of bridge buffers shared by every layer and bucket
    (:mod:`bcg.ops.bridge`), so the tensors each graph must keep alive do not add up over the ladder.

    Under tensor parallel the ranks are aligned before each island at capture (``barrier_fn``) and a replay whose
    island raises still launches its remaining segments (:meth:`~bcg.BreakableCUDAGraph.replay_draining`), so the
    all-reduces captured in them release the other ranks; the runner then reruns the batch eagerly everywhere.
    """

    name = "breakable"

    def prepare(self) -> None:
        self.bridge = BridgeBuffers(self.resources.max_bucket)

    def capture(self, num_tokens: int) -> bcg.BreakableCUDAGraph:
        r = self.resources
        pool = r.pool.handle
        graph = bcg.BreakableCUDAGraph(pool=pool, emulate=r.is_emulated)
        step = bcg.eager_on_graph(r.step) if r.config.debug else r.step
        with bridge_buffers(self.bridge), bcg.breakable_graph(graph, pool=pool, stream=r.capture_stream,
                                                              barrier_fn=r.barrier_fn,
                                                              leak_check=r.config.leak_check):
            step(*r.inputs.step_args(num_tokens))
        return graph

    def replay(self, handle: Any, num_tokens: int) -> None:
        if self.resources.config.tp_size > 1:
            handle.replay_draining()
        else:
            handle.replay()

    def describe(self, handle: Any) -> tuple[int, int]:
        return (handle.num_segments, handle.num_breaks)
