"""Marking the functions a capture breaks at, and the context variable through which a running capture sees them.

``@eager_on_graph`` functions are the islands of a breakable graph: outside a capture they are the plain function;
while :class:`~bcg.capture.breakable_graph` runs (or :func:`observing_islands` watches), each call goes to whatever the
context variable holds. This file is apart from the capture machinery so that model code marking its islands, and
tools observing them, import only this and the graph's error type, not the capture.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from bcg.graph import CaptureError

__all__ = ["BreakHandler", "break_graph", "eager_on_graph", "force_no_graph", "is_capturing", "is_in_breakable_graph",
           "no_graph", "observing_islands"]

F = TypeVar("F", bound=Callable[..., Any])


class BreakHandler(Protocol):
    """What an island's wrapper finds in the context variable: a running capture (``bcg.capture``) or an observer."""

    is_capture: bool
    in_eager: bool

    def run_break(self, fn: Callable, name: str, stub: Callable | None, args: tuple, kwargs: dict) -> Any: ...


_CAPTURE: contextvars.ContextVar[BreakHandler | None] = contextvars.ContextVar("bcg_capture", default=None)


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
