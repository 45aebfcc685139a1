"""Capturing a :class:`~bcg.graph.BreakableCUDAGraph`: the ``breakable_graph`` context manager and the state of one
running capture.

``breakable_graph`` captures like ``torch.cuda.graph``; each call to an ``@eager_on_graph`` function inside it ends
the current segment, runs the function eagerly once, records it as an :class:`~bcg.graph.EagerStep`, and begins the
next segment. The capture state is what the islands' context variable (:mod:`bcg.islands`) holds meanwhile. Apart
from the graph, which only holds what a capture left behind, because this is where the process-wide state is: the
capture lock, the capture streams, side-stream tracking and the leak check.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg import collector, env, leaks, streams
from bcg.boundary import Boundary
from bcg.emulation import EmulatedGraph, poisoned
from bcg.graph import BreakableCUDAGraph, CaptureError, EagerStep, _warnings_lock
from bcg.islands import _CAPTURE
from bcg.tensors import storage_key, tensor_leaves

__all__ = ["breakable_graph"]

logger = logging.getLogger("bcg")
# Default capture streams per (device, thread): two threads capturing at once must not share a stream.
_default_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
# CUDA captures in one process are serialised: the device sync and cache flush that open a capture, and the caching
# allocator's bookkeeping, are not permitted while another thread's stream is capturing. Emulated captures and
# replays (in any thread) do not take this lock.
_cuda_capture_lock = threading.Lock()


class _CaptureState:
    """Bookkeeping of one running capture: the open segment, side streams and the first error.

    What ``eager_on_graph`` finds in the context variable: anything with ``in_eager`` and ``run_break`` (a
    recorder of eager calls, :mod:`bcg.recording`, stands in for a capture there with ``is_capture`` False).
    """

    is_capture = True

    def __init__(self, graph: BreakableCUDAGraph, pool: Any, mode: str, barrier_fn: Callable[[], Any] | None,
                 auto_join: bool, stream: torch.cuda.Stream | None, leak_check: str = "off") -> None:
        self.graph, self.pool, self.mode, self.leak_check = graph, pool, mode, leak_check
        self.barrier_fn, self.auto_join, self.stream = barrier_fn, auto_join, stream
        self.tracker = streams.StreamTracker(stream.cuda_stream) if stream is not None else None
        self.open: Any = None
        self.in_eager = False
        self.error: BaseException | None = None
        self.pool_poisoned = False  # a CUDA segment's capture_end failed (see BreakableCUDAGraph._discard_pool)
        self.unwritten: set[int] = set()  # emulation: storages this capture's segments allocated (garbage on CUDA)

    def begin_segment(self) -> None:
        seg = EmulatedGraph() if self.graph.is_emulated else torch.cuda.CUDAGraph()
        if self.tracker is not None:
            self.tracker.reset()
        seg.capture_begin(pool=self.pool, capture_error_mode=self.mode)
        self.open = seg

    def _join_side_streams(self, at: str, force: bool) -> None:
        if self.tracker is None or not self.tracker.forked:
            return
        pending = self.tracker.unjoined()
        if not (force or self.auto_join):
            ids = ", ".join(hex(s.cuda_stream) for s in pending)
            raise CaptureError(
                f"side stream(s) [{ids}] forked from the capture stream were not joined before {at}. A graph "
                "segment can only end once every forked stream has rejoined the capture stream. Fix: call "
                "torch.cuda.current_stream().wait_stream(side_stream) before that point, or pass "
                "auto_join_streams=True to bcg.breakable_graph(...)."
            )
        for s in pending:
            self.stream.wait_stream(s)
        self.tracker.reset()

    def end_segment(self, at: str) -> None:
        self._join_side_streams(at, force=False)
        seg, self.open = self.open, None
        if self.graph.is_emulated:
            seg.capture_end()
            is_empty = seg.num_ops == 0
            self.unwritten |= seg.fresh_storages()
        else:
            # catch_warnings swaps process-wide state: without the lock, a concurrent capture in another thread
            # could record this segment's "empty" warning (or lose its own) and drop the wrong segment.
            with _warnings_lock, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    seg.capture_end()
                except BaseException:
                    self.pool_poisoned = True
                    raise
            # torch warns "The CUDA Graph is empty" for a segment without nodes (consecutive breaks).
            is_empty = any("empty" in str(w.message) for w in caught)
            for w in caught:
                if "empty" not in str(w.message):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if not is_empty:
            self.graph._append(seg)
        if env.DEBUG:
            logger.debug("bcg: segment %s at %s", "dropped (empty)" if is_empty else "captured", at)

    def abort(self) -> None:
        """Ends an open segment whatever its state, so no stream is left capturing."""
        seg, self.open = self.open, None
        if seg is None:
            return
        try:
            self._join_side_streams("abort", force=True)
        except Exception:  # best effort: the capture is being thrown away
            pass
        try:
            seg.capture_end()
        except Exception:  # an invalidated capture (e.g. a host sync inside the segment)
            self.pool_poisoned = not self.graph.is_emulated

    def run_break(self, fn: Callable, name: str, stub: Callable | None, args: tuple, kwargs: dict) -> Any:
        if self.error is not None:
            raise CaptureError(f"the capture already failed before {name!r}") from self.error
        try:
            self.end_segment(at=f"the eager function {name!r}")
            if self.barrier_fn is not None:
                self.barrier_fn()
            self.in_eager = True
            call = stub if stub is not None else fn
            # Emulation: what a CUDA segment only recorded holds garbage when the function runs at capture.
            unwritten = [t for t in tensor_leaves((args, kwargs)) if storage_key(t) in self.unwritten] \
                if self.unwritten else []
            try:
                with poisoned(unwritten):
                    if self.leak_check == "off":
                        out = call(*args, **kwargs)
                    else:
                        out = leaks.checked_call(call, name, args, kwargs, self.leak_check)
            finally:
                self.in_eager = False
            self.graph._append(EagerStep(name, fn, args, kwargs, Boundary(name, out, self.graph.device_type)))
            self.begin_segment()
        except BaseException as e:
            self.error = e
            raise
        return out


class breakable_graph:
    """Context manager that captures a :class:`BreakableCUDAGraph`, like ``torch.cuda.graph``.

    Args:
        cuda_graph: the graph to capture into; it must be empty (call ``reset()`` to recapture).
        pool: memory pool handle; defaults to ``cuda_graph.pool()``.
        stream: the capture stream; defaults to a side stream per device (never the default stream).
        capture_error_mode: passed to ``CUDAGraph.capture_begin`` ("global", "thread_local" or "relaxed").
        barrier_fn: zero-argument callable run at capture right before each eager function, after the segment
            has ended (to re-align distributed ranks).
        auto_join_streams: join side streams that are still forked at a break instead of raising.
        leak_check: "warn" or "raise" when an eager function allocates a tensor at capture that outlives it but is
            neither returned nor written into an argument (:mod:`bcg.leaks`); "off" runs it bare. None reads the
            ``BCG_LEAK_CHECK`` environment variable (default "off"). Replay never checks.

    Example::

        g = bcg.BreakableCUDAGraph()
        with bcg.breakable_graph(g):
            y = layer2(attention(layer1(static_x)))   # attention is @bcg.eager_on_graph
        g.replay()

    One device synchronisation and cache cleanup happen per capture, not per segment. On any exception the open
    segment is ended, the graph is reset and the exception propagates. CUDA captures from several threads are
    serialised by a process-wide lock; a thread that works while another captures must stay off the legacy default
    stream, and the capture should use ``capture_error_mode="thread_local"`` so that thread's syncs are allowed.
    """

    def __init__(self, cuda_graph: BreakableCUDAGraph, pool: Any = None, stream: torch.cuda.Stream | None = None,
                 capture_error_mode: str = "global", barrier_fn: Callable[[], Any] | None = None,
                 auto_join_streams: bool = False, leak_check: str | None = None) -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode must be 'global', 'thread_local' or 'relaxed', "
                             f"not {capture_error_mode!r}")
        source = "leak_check"
        if leak_check is None:
            leak_check, source = env.leak_check_mode(), "BCG_LEAK_CHECK"
        if leak_check not in leaks.LEAK_CHECK_MODES:
            raise ValueError(f"{source} must be 'off', 'warn' or 'raise', not {leak_check!r}")
        self.leak_check = leak_check
        self.graph = cuda_graph
        self.pool = pool if pool is not None else cuda_graph.pool()
        self.stream, self.mode = stream, capture_error_mode
        self.barrier_fn, self.auto_join = barrier_fn, auto_join_streams
        self._state: _CaptureState | None = None
        self._token: contextvars.Token | None = None
        self._stream_ctx: Any = None
        self._outer: torch.cuda.Stream | None = None
        self._locked = False
        self._gc_held = False

    def __enter__(self) -> BreakableCUDAGraph:
        active = _CAPTURE.get()
        if active is not None and active.is_capture:
            raise CaptureError("a breakable capture is already running in this context; nested captures are "
                               "not supported. Capture the graphs one after another.")
        if self.graph.is_captured:
            raise CaptureError("this BreakableCUDAGraph already holds a capture; call reset() before "
                               "capturing it again")
        # No garbage collection mid-capture (bcg.collector says why).
        collector.hold()
        self._gc_held = True
        try:
            stream = self._enter_cuda() if not self.graph.is_emulated else None
            self._state = _CaptureState(self.graph, self.pool, self.mode, self.barrier_fn, self.auto_join, stream,
                                        self.leak_check)
            self._token = _CAPTURE.set(self._state)
            if stream is not None:
                streams.active_tracker().set(self._state.tracker)
            self.graph._hold_pool(self.pool, self.mode)
            self._state.begin_segment()
        except BaseException:
            self._cleanup(failed=True)
            raise
        return self.graph

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        state = self._state
        failed = exc is not None or state.error is not None
        try:
            if not failed:
                try:
                    state.end_segment(at="the end of the capture")
                except BaseException:
                    failed = True
                    raise
        finally:
            if failed:
                state.abort()
            self._cleanup(failed)
        if exc is None and state.error is not None:
            # The user swallowed an exception raised by an eager function; the capture is incomplete.
            raise CaptureError("the capture failed inside an eager function (see the cause); the graph was "
                               "reset") from state.error
        if exc is not None and hasattr(exc, "add_note") and not self.graph.is_emulated:
            exc.add_note("bcg: raised while capturing a breakable CUDA graph; the graph was reset. Host syncs "
                         "and data-dependent shapes belong in @bcg.eager_on_graph functions.")
        return False

    def _enter_cuda(self) -> torch.cuda.Stream:
        """Takes the process-wide capture lock, syncs once, and switches to the capture stream."""
        if torch.cuda.is_current_stream_capturing():
            raise CaptureError("a CUDA graph capture is already running on the current stream; nested "
                               "captures are not supported")
        _cuda_capture_lock.acquire()
        self._locked = True
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dev = torch.cuda.current_device()
        stream = self.stream or _default_streams.get((dev, threading.get_ident()))
        if stream is None:
            stream = _default_streams[(dev, threading.get_ident())] = torch.cuda.Stream(dev)
        self._outer = torch.cuda.current_stream()
        stream.wait_stream(self._outer)
        self._stream_ctx = torch.cuda.stream(stream)
        self._stream_ctx.__enter__()
        self._capture_stream = stream
        streams.install_hooks()
        return stream

    def _cleanup(self, failed: bool) -> None:
        if self._token is not None:
            _CAPTURE.reset(self._token)
            self._token = None
        if self._stream_ctx is not None:
            streams.active_tracker().set(None)
            streams.remove_hooks()
            self._stream_ctx.__exit__(None, None, None)
            self._outer.wait_stream(self._capture_stream)
            self._stream_ctx = None
        if failed:
            self.graph.reset()
            if self._state is not None and self._state.pool_poisoned:
                self.graph._discard_pool(self.pool)
        else:
            self.graph._is_captured = True
        if self._locked:
            self._locked = False
            _cuda_capture_lock.release()
        if self._gc_held:
            self._gc_held = False
            collector.release()

