"""The breakable CUDA graph: the replay sequence a capture leaves behind, graph segments and eager steps in order.

A :class:`BreakableCUDAGraph` is filled by :class:`~bcg.capture.breakable_graph`, split wherever an
:func:`~bcg.islands.eager_on_graph` function is called; ``replay()`` then launches segment 1, runs eager function 1,
launches segment 2, and so on. Tensors that cross a break are kept alive for the life of the graph, and what an eager
function returns is kept as a persistent boundary buffer that each replay refreshes in place (see
:mod:`bcg.boundary`). Without CUDA every segment is an :class:`~bcg.emulation.EmulatedGraph`, so the same logic runs on
a CPU. The graph and its steps are apart from how they are captured (:mod:`bcg.capture`) and how a function is marked
as a break (:mod:`bcg.islands`): both build on this file, which knows neither.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg.boundary import Boundary
from bcg.emulation import emulated_pool_handle

__all__ = ["BreakableCUDAGraph", "CaptureError", "EagerStep", "pool_anchor"]


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
        i = 0
        try:
            for i, fn in enumerate(self._replay_fns):  # noqa: B007 - i is read by the handler below
                fn()
        except Exception:
            for step, fn in zip(self._steps[i + 1:], self._replay_fns[i + 1:]):
                if not isinstance(step, EagerStep):
                    fn()
            raise

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


# catch_warnings swaps process-wide state: one lock for every block that records or silences capture warnings
# (anchoring a pool here, ending a segment in bcg.capture).
_warnings_lock = threading.Lock()


def pool_anchor(pool: Any, capture_error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """An empty CUDA graph captured into ``pool`` on the current (non-default) stream; while it lives, torch keeps
    the pool alive even when every other graph captured into it is destroyed (a failed or reset capture)."""
    anchor = torch.cuda.CUDAGraph()
    with _warnings_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        anchor.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        anchor.capture_end()
    return anchor
