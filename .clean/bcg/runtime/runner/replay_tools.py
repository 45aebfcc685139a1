"""The runner's methods for tools that look inside a replay (``bcg analyze``, verification, segment comparisons):
a batch loaded into its bucket's fields under its forward context, the bucket's step run eagerly on those same
fields, and one batch's hidden rows from the graph and from eager side by side.

They are the runner's public surface for such tools (DESIGN.md: tools use these, not the runner's attributes), mixed
into :class:`~bcg.runtime.runner.runner.Runner`; what they read is the runner's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from bcg.ops.context import forward_context
from bcg.runtime.backends import GraphBackend
from bcg.runtime.batch import PrefillBatch
from bcg.runtime.runner.buckets import BucketTable
from bcg.runtime.runner.inputs import StaticInputs
from bcg.runtime.runner.step import ModelStep

__all__ = ["ReplayTools"]


class ReplayTools:
    """Replay-inspection methods of :class:`~bcg.runtime.runner.runner.Runner` (which provides what is declared
    here)."""

    lock: threading.RLock
    inputs: StaticInputs
    table: BucketTable
    step: ModelStep
    backend: GraphBackend
    static_output: Tensor | None
    choose: Callable[[int, PrefillBatch], tuple[int | None, str]]  # the replay-or-eager predicate

    @contextmanager
    def replay_context(self, batch: PrefillBatch) -> Iterator[tuple[int, Any]]:
        """Loads ``batch`` into the fields of its bucket and sets its forward context; yields ``(bucket, handle)``.
        For tools that replay or time the steps of a handle themselves (``bcg analyze``, verification). Raises
        ValueError when the batch would not replay a graph."""
        with self.lock:
            bucket, reason = self.choose(batch.num_tokens, batch)
            if bucket is None:
                raise ValueError(f"a batch of {batch.num_tokens} tokens does not replay a graph ({reason})")
            loaded = self.inputs.load(batch, bucket)
            with forward_context(loaded.context):
                yield bucket, self.table.buckets[bucket].handle

    def run_step_eagerly(self, bucket: int) -> None:
        """Runs bucket ``bucket``'s step eagerly on its static fields (inside :meth:`replay_context`): the same
        inputs a replay reads, the same outputs it writes."""
        self.step(*self.inputs.step_args(bucket))

    def replay_and_eager(self, batch: PrefillBatch) -> tuple[Tensor, Tensor]:
        """``batch``'s bucket replayed, and the same padded inputs run eagerly under the same forward context:
        ``(graph_rows, eager_rows)`` of the hidden states of the real tokens (the differential check of
        :mod:`.verify`)."""
        n = batch.num_tokens
        with self.replay_context(batch) as (bucket, handle):
            self.backend.replay(handle, bucket)
            graph_out = self.static_output[:n].clone()
            self.run_step_eagerly(bucket)
            eager_out = self.static_output[:n].clone()
        return graph_out, eager_out
