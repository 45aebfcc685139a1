"""The breakable CUDA graph: a forward captured as graph segments split by eager functions.

``breakable_graph`` captures like ``torch.cuda.graph``; each call to an ``@eager_on_graph`` function inside it ends
the current segment, runs the function eagerly once, records it, and begins the next segment. ``replay()`` then
launches segment 1, runs eager function 1, launches segment 2, and so on. Tensors that cross a break are kept alive
for the life of the graph, and what an eager function returns is kept as a persistent boundary buffer that each
replay refreshes in place (see :mod:`bcg.boundary`). Without CUDA every segment is an
:class:`~bcg.emulation.EmulatedGraph`, so the same logic runs on a CPU.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from bcg import leaks, streams
from bcg.boundary import Boundary, BoundaryMismatchError
from bcg.emulation import EmulatedGraph, emulated_pool_handle
from bcg.leaks import LeakError, LeakWarning

__all__ = [
    "BoundaryMismatchError",
    "BreakableCUDAGraph",
    "CaptureError",
    "EagerStep",
    "LeakError",
    "LeakWarning",
    "break_graph",
    "breakable_graph",
    "eager_on_graph",
    "force_no_graph",
    "is_capturing",
    "is_in_breakable_graph",
    "no_graph",
    "observing_islands",
]

logger = logging.getLogger("bcg")
_DEBUG = os.environ.get("BCG_DEBUG", "") not in ("", "0")
F = TypeVar("F", bound=Callable[..., Any])


class CaptureError(RuntimeError):
    """A breakable capture could not be started or completed; the message names the cause and the fix."""


class EagerStep:
    """One break: the eager function, the arguments it was captured with, and its boundary buffers.

    Holding ``args``/``kwargs`` strongly is what keeps every tensor that crosses the break alive as long as the
    graph: a freed block could otherwise be handed to another graph in the same pool (SGLang #37606).
    """

    __slots__ = ("name", "fn", "args", "kwargs", "boundary", "inference")

    def __init__(self, name: str, fn: Callable, args: tuple, kwargs: dict, boundary: Boundary) -> None:
        self.name, self.fn, self.args, self.kwargs, self.boundary = name, fn, args, kwargs, boundary
        # Tensors made under inference_mode (the boundary buffers, often the arguments) can only be written in
        # inference mode, so a step captured there replays there, wherever replay() is called from.
        self.inference = torch.is_inference_mode_enabled()

    def __call__(self) -> None:
        if self.inference and not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                self.boundary.refresh(self.fn(*self.args, **self.kwargs))
            return
        self.boundary.refresh(self.fn(*self.args, **self.kwargs))

    def __repr__(self) -> str:
        return f"EagerStep({self.name})"


class BreakableCUDAGraph:
    """A captured sequence of CUDA graph segments and eager steps; mirrors ``torch.cuda.CUDAGraph``.

    Args:
        pool: a memory pool handle to capture into (``other.pool()``, ``torch.cuda.graph_pool_handle()`` or a
            ``torch.cuda.MemPool``); by default a private pool is created on first use.
        emulate: capture CPU-emulated segments instead of CUDA graphs. ``None`` emulates exactly when CUDA is
            unavailable.

    Example::

        g = bcg.BreakableCUDAGraph()
        with bcg.breakable_graph(g):
            out = model_step(static_in)      # calls @bcg.eager_on_graph functions inside
        static_in.copy_(new_data)
        g.replay()                           # out now holds the result for new_data
    """

    def __init__(self, pool: Any = None, emulate: bool | None = None) -> None:
        cuda = torch.cuda.is_available()
        self.is_emulated = (not cuda) if emulate is None else bool(emulate)
        if not self.is_emulated and not cuda:
            raise CaptureError("BreakableCUDAGraph(emulate=False) needs CUDA, which is not available here; "
                               "leave emulate=None to use the CPU emulation")
        if pool is not None and hasattr(pool, "id") and not isinstance(pool, tuple):
            pool = pool.id  # torch.cuda.MemPool
        self._pool = pool
        self._owns_pool = pool is None
        self._anchors: dict[Any, Any] = {}  # pool handle -> empty CUDAGraph holding a use of it (_hold_pool)
        self._is_captured = False
        self._steps: list[Any] = []  # segments (CUDAGraph / EmulatedGraph) and EagerSteps, in replay order
        self._replay_fns: list[Callable[[], None]] = []

    @property
    def device_type(self) -> str:
        return "cpu" if self.is_emulated else "cuda"

    def pool(self) -> Any:
        """The memory pool handle of this graph; pass it to another graph to share the pool."""
        if self._pool is None:
            self._pool = emulated_pool_handle() if self.is_emulated else torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def num_segments(self) -> int:
        """Captured graph segments (empty segments between consecutive breaks are not kept)."""
        return sum(not isinstance(s, EagerStep) for s in self._steps)

    @property
    def num_breaks(self) -> int:
        """Eager steps run between segments at replay."""
        return sum(isinstance(s, EagerStep) for s in self._steps)

    @property
    def steps(self) -> tuple[Any, ...]:
        """The replay sequence: segment graphs and :class:`EagerStep` objects, in order."""
        return tuple(self._steps)

    @property
    def is_captured(self) -> bool:
        """True after a successful capture (even one with no work), until ``reset()``."""
        return self._is_captured

    def replay(self) -> None:
        """Replays every segment and eager step in capture order on the current stream."""
        if not self._is_captured:
            raise RuntimeError("BreakableCUDAGraph.replay() before a successful capture")
        for fn in self._replay_fns:
            fn()

    def replay_draining(self) -> None:
        """Replays like :meth:`replay`, but if a step raises, the remaining segments are still launched (their eager
        steps skipped) before the first error propagates.

        For distributed replays: the collectives captured in the remaining segments are still issued, so peer ranks
        waiting in one of them are released instead of hanging until a timeout. A drained replay's outputs are
        garbage; the caller reruns the batch (tensor parallel runners rerun it eagerly on every rank).
        """
        if not self._is_captured:
            raise RuntimeError("BreakableCUDAGraph.replay_draining() before a successful capture")
        error: BaseException | None = None
        for step, fn in zip(self._steps, self._replay_fns):
            if error is None:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - re-raised once the segments are drained
                    error = e
            elif not isinstance(step, EagerStep):
                fn()
        if error is not None:
            raise error

    def reset(self) -> None:
        """Drops the captured segments and boundary buffers; the pool handle is kept for reuse."""
        self._steps.clear()
        self._replay_fns.clear()
        self._is_captured = False

    def _append(self, step: Any) -> None:
        self._steps.append(step)
        self._replay_fns.append(step if isinstance(step, EagerStep) else step.replay)

    def _hold_pool(self, pool: Any, mode: str) -> None:
        """Keeps one use of ``pool`` for the life of this graph (CUDA only; call on the capture stream).

        torch retires a private pool when the last CUDAGraph captured into it is destroyed, and a later
        ``capture_begin`` into the same handle then fails an internal assert (``use_count > 0``). Dropped empty
        segments, ``reset()`` and failed captures all destroy segments, so an empty graph stays as an anchor.
        """
        if self.is_emulated or pool in self._anchors:
            return
        self._anchors[pool] = pool_anchor(pool, mode)

    def _discard_pool(self, pool: Any) -> None:
        """An invalidated capture leaves its pool unusable in torch ("already recording"): use a new one."""
        self._anchors.pop(pool, None)
        if self._owns_pool and pool == self._pool:
            self._pool = None


_CAPTURE: contextvars.ContextVar[_CaptureState | None] = contextvars.ContextVar("bcg_capture", default=None)
# Default capture streams per (device, thread): two threads capturing at once must not share a stream.
_default_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
_warnings_lock = threading.Lock()
# CUDA captures in one process are serialised: the device sync and cache flush that open a capture, and the caching
# allocator's bookkeeping, are not permitted while another thread's stream is capturing. Emulated captures and
# replays (in any thread) do not take this lock.
_cuda_capture_lock = threading.Lock()


def pool_anchor(pool: Any, capture_error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """An empty CUDA graph captured into ``pool`` on the current (non-default) stream; while it lives, torch keeps
    the pool alive even when every other graph captured into it is destroyed (a failed or reset capture)."""
    anchor = torch.cuda.CUDAGraph()
    with _warnings_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        anchor.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        anchor.capture_end()
    return anchor


def is_capturing() -> bool:
    """True while a breakable capture is running in this context (also inside its eager functions)."""
    state = _CAPTURE.get()
    return state is not None and state.is_capture


class _IslandObserver:
    """Stands in for a capture state while :func:`observing_islands` is active: every eager function called (outside
    another one) goes to the observer's ``call`` instead, and nothing is captured."""

    is_capture = False  # is_capturing() stays False: models run as they do outside a capture

    def __init__(self, call: Callable[[Callable, str, tuple, dict], Any]) -> None:
        self.call, self.in_eager = call, False

    def run_break(self, fn: Callable, name: str, stub: Callable | None, args: tuple, kwargs: dict) -> Any:
        self.in_eager = True
        try:
            return self.call(fn, name, args, kwargs)
        finally:
            self.in_eager = False


@contextmanager
def observing_islands(call: Callable[[Callable, str, tuple, dict], Any]) -> Iterator[None]:
    """Outside any capture, routes every ``@eager_on_graph`` call of the block to ``call(fn, name, args, kwargs)``,
    which runs it (``fn(*args, **kwargs)``) and returns its result.

    For tools that watch what a forward would capture or break at: the capturability probe (:mod:`bcg.probe`) pauses
    inside islands, whose ops run at replay and never in a segment; the segment check (:mod:`bcg.recording`) records
    each island's inputs and outputs. Islands called from an island run plainly, as in a capture. Nothing is
    captured and :func:`is_capturing` stays False.

    Example:
        >>> import torch
        >>> seen = []
        >>> @eager_on_graph
        ... def island(x):
        ...     return x + 1
        >>> with observing_islands(lambda fn, name, args, kwargs: seen.append(name) or fn(*args, **kwargs)):
        ...     _ = island(torch.zeros(1))
        >>> seen
        ['island']
    """
    if _CAPTURE.get() is not None:
        raise CaptureError("observing_islands() cannot run inside a breakable capture or another observer")
    token = _CAPTURE.set(_IslandObserver(call))
    try:
        yield
    finally:
        _CAPTURE.reset(token)


is_in_breakable_graph = is_capturing


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
        if _DEBUG:
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
            try:
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
            leak_check, source = os.environ.get("BCG_LEAK_CHECK", "") or "off", "BCG_LEAK_CHECK"
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

    def __enter__(self) -> BreakableCUDAGraph:
        active = _CAPTURE.get()
        if active is not None and active.is_capture:
            raise CaptureError("a breakable capture is already running in this context; nested captures are "
                               "not supported. Capture the graphs one after another.")
        if self.graph.is_captured:
            raise CaptureError("this BreakableCUDAGraph already holds a capture; call reset() before "
                               "capturing it again")
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


def eager_on_graph(fn: F | None = None, *, enable: bool = True,
                   capture_stub: Callable[..., Any] | None = None) -> Any:
    """Marks a function that runs eagerly between graph segments instead of being captured.

    Outside a capture the decorated function is the plain function (one context lookup of overhead). Inside
    ``breakable_graph`` a call ends the current segment, runs the function (or ``capture_stub``, at capture only)
    once, records it with its arguments, and begins the next segment. Replay always runs the real function with the
    captured arguments, so it must read its inputs from tensors (fixed addresses), not from Python values that
    change between replays. A returned tensor (or tuple/list/dict/dataclass of tensors) becomes a boundary buffer
    that replay refreshes in place; returning None and writing into argument tensors costs no copy.

    Usable bare or configured::

        @bcg.eager_on_graph
        def attention(q, k, v, out): ...

        @bcg.eager_on_graph(enable=use_islands, capture_stub=lambda x: torch.empty_like(x))
        def all_gather(x): ...
    """

    def wrap(f: F) -> F:
        if not enable:
            return f
        name = getattr(f, "__qualname__", None) or repr(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = _CAPTURE.get()
            if state is None or state.in_eager:
                return f(*args, **kwargs)
            return state.run_break(f, name, capture_stub, args, kwargs)

        wrapper.__bcg_eager__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return wrap if fn is None else wrap(fn)


@eager_on_graph
def break_graph() -> None:
    """Forces a segment split at this point with no eager work (a no-op outside a capture)."""
    return None


no_graph = eager_on_graph  # alias for users of Meta's breakable-cuda-graphs
force_no_graph = break_graph
