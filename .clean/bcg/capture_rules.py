"""What a CUDA graph cannot capture: the rules for aten calls, and the guards for host reads the dispatcher never sees.

Apart from the emulation because two tools apply the same rules: every emulated capture (:mod:`bcg.emulation`)
raises on the first offending call, and the capturability probe (:mod:`bcg.probe`) reports every one without
capturing. Aten calls are judged by :func:`uncapturable_reason`; the host reads that never reach the dispatcher for
CPU tensors (:data:`HOST_READ_METHODS`) are caught by guards on ``torch.Tensor`` methods, installed only while an
emulated segment is being captured or :func:`reporting_host_reads` is active.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

__all__ = ["HOST_READ_METHODS", "CapturingSegment", "UncapturableOpError", "begin_segment_capture",
           "check_capturable", "end_segment_capture", "is_emulated_capturing", "reporting_host_reads",
           "uncapturable_reason"]

aten = torch.ops.aten


class UncapturableOpError(RuntimeError):
    """An operation that a CUDA graph cannot capture was called during an (emulated) capture."""


class CapturingSegment(Protocol):
    """The emulated segment being captured (an :class:`~bcg.emulation.EmulatedGraph`), as the rules see it."""

    _invalid: str | None  # the first uncapturable call's message; set once, kept even if the error is caught


# The EmulatedGraph being captured in this context (None outside a capture).
_CAPTURING: contextvars.ContextVar[CapturingSegment | None] = contextvars.ContextVar(
    "bcg_emulated_capturing", default=None)


def begin_segment_capture(segment: CapturingSegment) -> contextvars.Token:
    """Makes ``segment`` the one being captured in this context, with the host-read guards on."""
    _install_guards()
    return _CAPTURING.set(segment)


def end_segment_capture(token: contextvars.Token) -> None:
    """Ends what :func:`begin_segment_capture` began (``token`` is its return value)."""
    _CAPTURING.reset(token)
    _remove_guards()


def is_emulated_capturing() -> bool:
    """True while an emulated segment is being captured in the current context."""
    return _CAPTURING.get() is not None


def _uncapturable(message: str) -> UncapturableOpError:
    """The error for an uncapturable op; like a CUDA capture, the segment stays invalid even if it is caught."""
    graph = _CAPTURING.get()
    if graph is not None and graph._invalid is None:
        graph._invalid = message
    return UncapturableOpError(message)


_FIX = "Move it into an @eager_on_graph function, or keep shapes fixed and the values on the device."
_ALWAYS = {
    aten._local_scalar_dense: "a host read of a tensor value (.item(), int(t), float(t), bool(t), `if t:`)",
    aten.item: "a host read of a tensor value (.item(), int(t) or float(t) under inference mode)",
    # Under inference mode bool(t) reaches the dispatcher as is_nonzero, not _local_scalar_dense.
    aten.is_nonzero: "a host read of a tensor value (bool(t), `if t:`)",
    aten.equal: "torch.equal, which returns a Python bool (a host sync)",
    aten.allclose: "torch.allclose, which returns a Python bool (a host sync)",
    aten.nonzero: "nonzero (or torch.where(cond) / argwhere), whose output shape depends on the data",
    aten.masked_select: "masked_select, whose output shape depends on the data",
    aten._unique: "unique, whose output shape depends on the data",
    aten._unique2: "unique, whose output shape depends on the data",
    aten.unique_dim: "unique, whose output shape depends on the data",
    aten.unique_consecutive: "unique_consecutive, whose output shape depends on the data",
    aten.bincount: "bincount, which reads the maximum back to the host",
    aten.lift_fresh: "creating a tensor from Python data (torch.tensor(...)), a host-to-device copy on CUDA",
    aten.lift_fresh_copy: "creating a tensor from Python data (torch.tensor(...)), a host-to-device copy on CUDA",
}
_BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# Distributed calls that make the host wait for the other ranks: never part of a CUDA graph.
_HOST_SYNC_COLLECTIVES = {"barrier": "a distributed barrier, which makes the host wait for every rank",
                          "monitored_barrier_": "a distributed barrier, which makes the host wait for every rank"}
_C10D = "c10d"  # the namespace of torch.distributed's ops


def uncapturable_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why a CUDA graph cannot capture this aten call (a short phrase), or None when it can.

    The rules every emulated capture applies; :mod:`bcg.probe` applies the same ones to find offenders without
    capturing.

    Example:
        >>> x = torch.ones(3)
        >>> uncapturable_reason(aten.nonzero.default, (x,), {})
        'nonzero (or torch.where(cond) / argwhere), whose output shape depends on the data'
        >>> uncapturable_reason(aten.repeat_interleave.self_int, (x, 2), {}) is None
        True
    """
    packet = func.overloadpacket
    reason = _ALWAYS.get(packet)
    if reason is None and func.namespace == _C10D:
        reason = _HOST_SYNC_COLLECTIVES.get(func._schema.name.split("::")[-1])
    if reason is None and packet in _BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            reason = "boolean-mask indexing, whose output shape depends on the data"
    elif reason is None and packet is aten.repeat_interleave:
        # Only tensor repeats size the output by their sum (a host read). Under inference mode the int-repeats
        # overload (self_int) arrives undecomposed; it is an expand and a copy, capturable.
        if func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None:
            reason = "repeat_interleave with tensor repeats and no output_size"
    elif reason is None and packet is aten.where and func._overloadname == "default":
        # torch.where(cond) with one argument (nonzero's tuple form; it arrives undecomposed under inference mode)
        reason = "torch.where(cond) with one argument (nonzero), whose output shape depends on the data"
    elif reason is None and packet is aten.one_hot:
        num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        if num_classes == -1:
            reason = "one_hot without num_classes, which reads the maximum back to the host"
    return reason


def check_capturable(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Raises :class:`UncapturableOpError` for a call :func:`uncapturable_reason` refuses; the segment being
    captured stays invalid even if the error is caught."""
    reason = uncapturable_reason(func, args, kwargs)
    if reason is not None:
        raise _uncapturable(f"{func} cannot be captured in a CUDA graph: {reason}. {_FIX}")


# Called with the method's name on a host read outside a capture, while :func:`reporting_host_reads` is active.
_HOST_READ_HOOK: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("bcg_host_read_hook",
                                                                                              default=None)


def _host_read_guard(name: str, original: Callable) -> Callable:
    def guarded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _CAPTURING.get() is not None:
            raise _uncapturable(
                f"Tensor.{name}() cannot be captured in a CUDA graph: it copies device memory to the host "
                f"and synchronizes. {_FIX}"
            )
        hook = _HOST_READ_HOOK.get()
        if hook is not None:
            token = _HOST_READ_HOOK.set(None)  # what the hook itself does is not reported
            try:
                hook(name)
            finally:
                _HOST_READ_HOOK.reset(token)
        return original(self, *args, **kwargs)

    guarded.__name__ = name
    guarded.__doc__ = original.__doc__
    return guarded


# Host reads that do not reach the dispatcher for CPU tensors, so the dispatch mode cannot see them.
HOST_READ_METHODS = ("tolist", "numpy", "__array__", "cpu", "__repr__", "__format__")
_guard_lock = threading.Lock()
_guard_users = 0
_originals: dict[str, Callable] = {}


def _install_guards() -> None:
    global _guard_users
    with _guard_lock:
        if _guard_users == 0:
            for name in HOST_READ_METHODS:
                _originals[name] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _host_read_guard(name, _originals[name]))
        _guard_users += 1


def _remove_guards() -> None:
    global _guard_users
    with _guard_lock:
        _guard_users -= 1
        if _guard_users == 0:
            for name, fn in _originals.items():
                setattr(torch.Tensor, name, fn)
            _originals.clear()


@contextmanager
def reporting_host_reads(report: Callable[[str], None]) -> Iterator[None]:
    """Inside the block, each host read that never reaches the dispatcher on a CPU (:data:`HOST_READ_METHODS`:
    ``tolist``, ``numpy``, ``cpu``, printing...) calls ``report(method_name)`` first; used by :mod:`bcg.probe`.

    Example:
        >>> seen = []
        >>> with reporting_host_reads(seen.append):
        ...     _ = torch.ones(2).tolist()
        >>> seen
        ['tolist']
    """
    _install_guards()
    token = _HOST_READ_HOOK.set(report)
    try:
        yield
    finally:
        _HOST_READ_HOOK.reset(token)
        _remove_guards()
