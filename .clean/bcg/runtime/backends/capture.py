"""Plain (unbreakable) graph capture shared by the "full" and "tc_piecewise" backends.

Both capture ordinary ``torch.cuda.CUDAGraph`` objects into the runner's shared pool on its capture stream, or
:class:`~bcg.emulation.EmulatedGraph` objects on a CPU, so the same backend code runs in CI and on a GPU.
``capture_begin``/``capture_end`` are called directly rather than through ``torch.cuda.graph``, which would
synchronise the device and empty the allocator cache for every graph (tc_piecewise captures two per layer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from bcg.emulation import EmulatedGraph
from bcg.graph import pool_anchor

__all__ = ["GraphPool", "capturing", "new_graph"]


def new_graph(emulate: bool) -> Any:
    """An empty graph: an :class:`EmulatedGraph` when emulating, else a ``torch.cuda.CUDAGraph``."""
    return EmulatedGraph() if emulate else torch.cuda.CUDAGraph()


@contextmanager
def capturing(graph: Any, pool: Any = None, stream: torch.cuda.Stream | None = None) -> Iterator[Any]:
    """Captures the body of the ``with`` block into ``graph`` (in ``pool``, on ``stream``).

    On CUDA the capture runs on ``stream`` (default: the current stream, which must not be the legacy default
    stream), ordered after the work already queued on the current stream, which in turn waits for the capture.
    If the body raises, the capture is ended (ignoring a second error from an invalidated capture) and the first
    exception propagates, so no stream is left capturing.

    Example::

        g = new_graph(emulate=not torch.cuda.is_available())
        with capturing(g, pool, capture_stream):
            static_out.copy_(fn(static_in))
        g.replay()
    """
    emulated = isinstance(graph, EmulatedGraph)
    outer = None if emulated else torch.cuda.current_stream()
    stream = None if emulated else (stream if stream is not None else outer)
    if stream is not None and stream != outer:
        stream.wait_stream(outer)
    with nullcontext() if emulated else torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield graph
        except BaseException:
            _end_quietly(graph)
            raise
        graph.capture_end()
    if stream is not None and stream != outer:
        outer.wait_stream(stream)


def _end_quietly(graph: Any) -> None:
    try:
        graph.capture_end()
    except Exception:  # the capture is being thrown away; the body's error is the one to report
        pass


class GraphPool:
    """The graph memory pool every backend of a runner captures into, with the anchor that keeps it alive.

    torch retires a graph pool when the last graph captured into it is destroyed, and a later ``capture_begin``
    into the same handle then fails an internal assert; a bucket whose capture fails destroys its graph, so without
    an anchor (an empty graph captured into the pool, :func:`bcg.graph.pool_anchor`) one failed bucket would break
    every bucket captured after it. A capture that failed inside CUDA can also leave the pool itself unusable
    ("already recording"): :meth:`renew` moves every later capture of every backend to a fresh, anchored pool.
    Backends read :attr:`handle` at each capture and never keep it.

    Example::

        pool = GraphPool(stream=capture_stream)        # GraphPool(None) when emulating: handle is None
        graph.capture_begin(pool=pool.handle)
        ...
        pool.renew()                                   # after a failed capture
    """

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self.handle: Any = None
        self._anchor: Any = None
        self.num_renewals = 0
        if stream is not None:
            self._new()

    def _new(self) -> None:
        handle = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(self._stream):
            self._anchor = pool_anchor(handle)
        self.handle = handle

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream this pool's graphs are captured on (None when emulating)."""
        return self._stream

    def renew(self) -> None:
        """Later captures go to a fresh pool (no-op when emulating); graphs already captured keep theirs."""
        if self._stream is not None:
            self._new()
            self.num_renewals += 1
