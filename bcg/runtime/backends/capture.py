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

__all__ = ["capturing", "hold_pool", "new_graph"]


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
    except Exception:  # noqa: BLE001 - the capture is being thrown away; the body's error is the one to report
        pass


def hold_pool(pool: Any, stream: torch.cuda.Stream | None) -> Any:
    """An empty CUDA graph captured into ``pool`` that keeps the pool alive; keep it as long as the pool is used.

    torch retires a graph pool when the last graph captured into it is destroyed, and a later ``capture_begin``
    into the same handle then fails an internal assert; a bucket whose capture fails destroys its graph, so
    without an anchor one failed bucket would break every bucket captured after it. None when emulating.
    """
    if pool is None:
        return None
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        return pool_anchor(pool)
