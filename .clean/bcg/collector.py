"""No garbage collection while a capture is underway.

A collection in the middle of a capture may find an unreachable graph from earlier (kept by a reference cycle: an
exception's traceback, a dropped engine) and destroy it; destroying a CUDA graph (``cudaGraphExecDestroy``) is an
unsafe call during a capture, and it invalidates the capture, whose end then fails with "operation failed due to a
previous error during capture". :class:`bcg.breakable_graph` holds the collector off from its start to its end; the
garbage waits for the next collection after it. The CPU emulation applies the same rule
(:mod:`bcg.emulation`), so a capture that would fail this way on a GPU fails on a CPU too. :func:`held` is the same
hold as a ``with`` block, for other work that makes many objects and frees none (reading a profile's records: a
collection every few thousand of them walks the whole heap).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["held", "hold", "release"]

_gc_lock = threading.Lock()
_gc_holds = 0  # captures underway in this process (threads may capture at once)
_gc_was_enabled = False


def hold() -> None:
    """The first capture underway turns the garbage collector off; :func:`release` by the last turns it back on
    if it was on."""
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1


def release() -> None:
    global _gc_holds
    with _gc_lock:
        _gc_holds -= 1
        if _gc_holds == 0 and _gc_was_enabled:
            gc.enable()


@contextmanager
def held() -> Iterator[None]:
    """No garbage collection inside the block (:func:`hold` and :func:`release` around it).

    Example::

        with held():
            events = [make(r) for r in records]   # hundreds of thousands of objects, none garbage
    """
    hold()
    try:
        yield
    finally:
        release()
