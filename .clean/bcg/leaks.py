"""The capture-time leak detector: tensors an eager function allocates and keeps, but neither returns nor writes into
an argument.

Graph segments read tensors by address. What an eager function returns becomes a boundary buffer refreshed in place
at every replay, and what it writes into its arguments lands at their fixed addresses; but a tensor it allocates and
stashes elsewhere (on ``self``, in a global cache) is a new tensor at every replay, while a later segment captured the
address of the one made at capture: that segment reads stale memory forever, with no error. This is the bug class
SGLang's users hit with breakable graphs. With ``leak_check="warn"`` or ``"raise"`` (see
:func:`bcg.breakable_graph`, or ``BCG_LEAK_CHECK``), each eager function runs at capture under a dispatch mode that
notes every storage allocated during the call; afterwards, the ones still alive that are not reachable from the
return value and are not an argument's storage are reported. Replay never runs the check, and ``"off"`` (the
default) runs the function bare.

A lazily built cache that nothing captured reads is reported too (it is harmless); build it before the capture,
return it, or declare it with :func:`mark_private` (tensors only eager functions read, e.g. a per-forward memo of the
live batch's metadata that several islands share).
"""

from __future__ import annotations

import contextvars
import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.tensors import storage_key, tensor_leaves

__all__ = ["LEAK_CHECK_MODES", "LeakError", "LeakWarning", "checked_call", "mark_private"]

LEAK_CHECK_MODES = ("off", "warn", "raise")


class LeakWarning(UserWarning):
    """An eager function kept a tensor it allocated at capture without returning it (see :mod:`bcg.leaks`)."""


class LeakError(RuntimeError):
    """``leak_check="raise"``: an eager function kept a tensor it allocated at capture without returning it."""


class _Allocations(TorchDispatchMode):
    """Notes the storages allocated by the ops of one call, and weak references to every tensor viewing them."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: dict[int, str] = {}  # storage address -> the op that allocated it
        self.views: list[weakref.ref] = []
        self.private: set[int] = set()  # storages the function declared eager-only (mark_private)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = tensor_leaves(out)
        if outputs:
            inputs = {storage_key(t) for t in tensor_leaves((args, kwargs))}
            for t in outputs:
                ptr = storage_key(t)
                if ptr == 0:
                    continue
                if ptr not in inputs and ptr not in self.fresh:
                    self.fresh[ptr] = str(func)
                if ptr in self.fresh:
                    self.views.append(weakref.ref(t))
        return out


_ACTIVE: contextvars.ContextVar[_Allocations | None] = contextvars.ContextVar("bcg_leak_check", default=None)


def mark_private(value: Any) -> Any:
    """Declares the tensors in ``value`` eager-only: kept by the eager function for later eager calls, never read by
    a graph segment, so the leak check of the call running now does not report them. Returns ``value``.

    Example::

        plan = mark_private(build_plan())   # in an island: reused by the next islands of the forward
    """
    allocs = _ACTIVE.get()
    if allocs is not None:
        allocs.private.update(storage_key(t) for t in tensor_leaves(value))
    return value


def _kept(allocs: _Allocations, exempt: set[int]) -> dict[int, torch.Tensor]:
    kept: dict[int, torch.Tensor] = {}
    for ref in allocs.views:
        t = ref()
        if t is not None:
            ptr = storage_key(t)
            if ptr in allocs.fresh and ptr not in exempt:
                kept.setdefault(ptr, t)
    return kept


def checked_call(fn: Callable[..., Any], name: str, args: tuple, kwargs: dict, mode: str) -> Any:
    """Calls ``fn(*args, **kwargs)`` and reports the tensors it allocated and kept but did not return.

    ``mode`` is "warn" (a :class:`LeakWarning`) or "raise" (a :class:`LeakError`).

    Example::

        out = checked_call(island, "island", (x,), {}, "raise")
    """
    allocs = _Allocations()
    token = _ACTIVE.set(allocs)
    try:
        with allocs:
            out = fn(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)
    exempt = {storage_key(t) for t in tensor_leaves((out, args, kwargs))} | allocs.private
    if not _kept(allocs, exempt):
        return out
    gc.collect()  # a tensor kept only by a reference cycle is garbage, not a leak
    kept = _kept(allocs, exempt)
    if kept:
        _report(name, kept, allocs.fresh, mode)
    return out


def _report(name: str, kept: dict[int, torch.Tensor], ops: dict[int, str], mode: str) -> None:
    shown = "; ".join(f"Tensor(shape={list(t.shape)}, dtype={t.dtype}, device={t.device}) from {ops[ptr]}"
                      for ptr, t in list(kept.items())[:4])
    more = f" and {len(kept) - 4} more" if len(kept) > 4 else ""
    message = (
        f"eager function {name!r} allocated {len(kept)} tensor(s) at capture that outlive the call but are neither "
        f"returned nor written into an argument: {shown}{more}. Replay allocates new ones, so a later graph segment "
        "that reads such a tensor reads the capture-time copy forever (a silent wrong answer). Return it (it becomes "
        "a boundary buffer) or write it into a preallocated argument; a cache no segment reads is harmless (build it "
        "before the capture to silence this)."
    )
    if mode == "raise":
        raise LeakError(message)
    warnings.warn(message, LeakWarning, stacklevel=4)
