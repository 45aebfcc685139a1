"""CPU emulation of a CUDA graph, so capture/replay logic runs and is tested on machines without a GPU.

``EmulatedGraph`` mirrors the part of ``torch.cuda.CUDAGraph`` that bcg uses (``capture_begin``, ``capture_end``,
``replay``). While capturing, a dispatch mode records every aten op with the very tensors it read and wrote. Replay
re-executes the recorded ops against the same storages and copies fresh results into the recorded outputs, so:

- outputs reflect the *current* contents of static inputs (tensors are addresses, as in a CUDA graph);
- Python values (ints, floats, shapes, branches taken) stay baked at their capture-time values;
- anything that cannot be captured on CUDA fails here too, with :class:`UncapturableOpError`: host reads
  (``.item()``, ``int(t)``, ``if t:``, ``.tolist()``, ``.numpy()``, ``.cpu()``, printing a tensor),
  data-dependent output shapes (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
  ``bincount``, ``repeat_interleave`` with tensor repeats and no ``output_size``), ``torch.equal``,
  ``torch.allclose`` and creating tensors from Python data (a host-to-device copy on CUDA).

Because every tensor of an emulated capture stands for device memory, host-side metadata must be read outside the
capture, exactly as it must on a GPU. Emulation is for correctness, not speed.

Known divergence: on CUDA, capture does not execute kernels, so values computed during capture are garbage; the
emulation executes them. Code that relies on capture-time values (rather than using ``capture_stub``) can therefore
pass here and fail on a GPU; the CUDA test tier covers that.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READ_METHODS", "RECORDS_COMPILED_CODE", "EmulatedGraph", "UncapturableOpError",
           "emulated_pool_handle", "is_emulated_capturing", "reporting_host_reads", "uncapturable_reason"]

aten = torch.ops.aten


class UncapturableOpError(RuntimeError):
    """An operation that a CUDA graph cannot capture was called during an (emulated) capture."""


# The EmulatedGraph being captured in this context (None outside a capture).
_CAPTURING: contextvars.ContextVar[EmulatedGraph | None] = contextvars.ContextVar("bcg_emulated_capturing",
                                                                                  default=None)
_pool_ids = itertools.count(1)


def emulated_pool_handle() -> tuple[int, int]:
    """A fresh pool id, shaped like ``torch.cuda.graph_pool_handle()``; the emulation has no memory reuse."""
    return (0, next(_pool_ids))


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


def _check_capturable(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Op:
    """One recorded aten call and which of its outputs need a copy back after re-execution."""

    __slots__ = ("func", "args", "kwargs", "outputs", "copy_back")

    def __init__(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        inputs = {_storage_key(t) for t in _tensors(args) + _tensors(list(kwargs.values()))}
        self.outputs = _tensors(out)
        # Outputs that alias an input (views, in-place and out= ops) already live at the recorded address;
        # freshly allocated outputs must be copied back so later ops read them where they were captured.
        self.copy_back = [_storage_key(t) not in inputs for t in self.outputs]

    def run(self) -> None:
        fresh = _tensors(self.func(*self.args, **self.kwargs))
        for recorded, new, copy in zip(self.outputs, fresh, self.copy_back):
            if copy:
                recorded.copy_(new)


def _is_noop_on_replay(func: torch._ops.OpOverload, op: _Op) -> bool:
    """Ops a real graph would hold no kernel for, or whose re-execution is redundant."""
    if torch.Tag.inplace_view in func.tags:  # metadata-only (unsqueeze_, t_, ...): no kernel in a real graph
        return True
    if func.overloadpacket in (aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
                               aten.new_empty_strided):
        return True  # contents are undefined anyway
    returns = func._schema.returns
    may_alias = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    # A read-only op that *may* alias (view, reshape, .to) and did alias does no work; if it copied instead
    # (``.to`` to another dtype, ``reshape`` of a non-contiguous tensor) it must be replayed like any op.
    return may_alias and not any(op.copy_back)


# Whether a compiled function called during an emulated capture runs its compiled artifact (recorded op by op) rather
# than falling back to eager Python: torch versions whose dispatch modes can ignore compile internals.
RECORDS_COMPILED_CODE = hasattr(TorchDispatchMode, "ignore_compile_internals")


class _RecordMode(TorchDispatchMode):
    def __init__(self, ops: list[_Op]) -> None:
        super().__init__()
        self.ops = ops

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled function called during a capture runs its compiled artifact, whose ops this mode records, as a
        # CUDA capture records the artifact's kernels; without this, torch.compile would fall back to eager Python.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        _check_capturable(func, args, kwargs)
        out = func(*args, **kwargs)
        op = _Op(func, args, kwargs, out)
        if not _is_noop_on_replay(func, op):
            self.ops.append(op)
        return out


class EmulatedGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` with the same capture/replay semantics (see module doc).

    Example::

        g = EmulatedGraph()
        x = torch.zeros(4)
        g.capture_begin()
        y = x * 2 + 1
        g.capture_end()
        x.fill_(3.0)
        g.replay()          # y is now 7.0 everywhere
    """

    def __init__(self) -> None:
        self._ops: list[_Op] = []
        self._mode: _RecordMode | None = None
        self._token: contextvars.Token | None = None
        self._inference = False
        self._captured = False
        self._invalid: str | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._mode is not None or self._captured:
            raise RuntimeError("this EmulatedGraph was already captured; create a new one")
        self._inference = torch.is_inference_mode_enabled()
        self._mode = _RecordMode(self._ops)
        _install_guards()
        self._token = _CAPTURING.set(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        if self._mode is None:
            raise RuntimeError("capture_end() without capture_begin()")
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            _CAPTURING.reset(self._token)
            self._token = None
            _remove_guards()
            self._captured = True
        if self._invalid is not None:
            # cudaStreamEndCapture fails once an illegal call invalidated the capture, even if it was caught.
            raise UncapturableOpError(f"the capture was invalidated by an earlier uncapturable operation: "
                                      f"{self._invalid}")

    @property
    def num_ops(self) -> int:
        """Recorded ops that replay re-executes (0 means an empty graph)."""
        return len(self._ops)

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("replay() before the graph was captured")
        # Replay under the grad mode of the capture: inference tensors can only be written in inference mode.
        with torch.inference_mode() if self._inference else torch.no_grad():
            for op in self._ops:
                op.run()

    def reset(self) -> None:
        self._ops = []
        self._captured = False
        self._invalid = None
