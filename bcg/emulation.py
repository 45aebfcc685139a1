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
  ``torch.allclose``, creating tensors from Python data (a host-to-device copy on CUDA) and distributed barriers
  (the host waits for the other ranks);
- collectives (``torch.distributed.all_reduce`` and the other ``c10d`` ops, functional collectives) are recorded
  but not issued at capture, as NCCL records them into a CUDA graph, and replay issues them as real collectives
  over the same process group (gloo on a CPU) and waits for them before the next op reads their output.

Because every tensor of an emulated capture stands for device memory, host-side metadata must be read outside the
capture, exactly as it must on a GPU. Emulation is for correctness, not speed.

Known divergence: on CUDA, capture does not execute kernels, so values computed during capture are garbage; the
emulation executes them (all but collectives, so ranks are no more coupled during a capture than on CUDA). Code
that relies on capture-time values (rather than using ``capture_stub``) can therefore pass here and fail on a GPU;
the CUDA test tier covers that.
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
# Distributed calls that make the host wait for the other ranks: never part of a CUDA graph.
_HOST_SYNC_COLLECTIVES = {"barrier": "a distributed barrier, which makes the host wait for every rank",
                          "monitored_barrier_": "a distributed barrier, which makes the host wait for every rank"}
_C10D, _FUNCTIONAL = "c10d", "_c10d_functional"


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


def _wait_works(out: Any) -> None:
    """Waits for the ``c10d`` Work objects among an op's results (a ``torch.ScriptObject`` each)."""
    for value in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(value, torch.ScriptObject):
            torch._C._distributed_c10d.Work.unbox(value).wait()


def _completed_work() -> Any:
    """A finished ``c10d`` Work, as a dispatcher value: what a collective not issued at capture returns."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def _record_collective(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """The result of a collective at capture, without issuing it: like NCCL under a CUDA graph capture, the
    collective happens at each replay, not now (values at capture are not reduced, as on CUDA they are garbage).

    ``c10d`` ops write their first argument and return it with a Work (or a Work alone); functional collectives
    return their input when in place and an output of the right shape (from the op's meta kernel) otherwise.
    """
    returns = func._schema.returns
    if func.namespace == _C10D:
        if returns and "Work" in str(returns[-1].type):
            return _completed_work() if len(returns) == 1 else (args[0], _completed_work())
        return func(*args, **kwargs)
    name = func._schema.name.split("::")[-1]
    if name == "wait_tensor" or all(r.alias_info is not None and r.alias_info.is_write for r in returns):
        return args[0]
    try:
        meta = func(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    except (NotImplementedError, RuntimeError):  # no meta kernel: issue it now (it is waited for at replay too)
        return func(*args, **kwargs)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return torch.empty(meta.shape, dtype=meta.dtype, device=device)


class _Op:
    """One recorded aten call and which of its outputs need a copy back after re-execution."""

    __slots__ = ("func", "args", "kwargs", "outputs", "copy_back", "collective")

    def __init__(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        inputs = {_storage_key(t) for t in _tensors(args) + _tensors(list(kwargs.values()))}
        self.outputs = _tensors(out)
        # Outputs that alias an input (views, in-place and out= ops) already live at the recorded address;
        # freshly allocated outputs must be copied back so later ops read them where they were captured.
        self.copy_back = [_storage_key(t) not in inputs for t in self.outputs]
        namespace = getattr(func, "namespace", None)
        self.collective = namespace if namespace in (_C10D, _FUNCTIONAL) else None

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.collective is not None:
            # A collective on a CPU process group runs asynchronously: on CUDA the stream orders what follows it,
            # here it must have finished before the next op reads (or a copy back reads) its output.
            if self.collective == _C10D:
                _wait_works(result)
            elif any(self.copy_back):
                for t in _tensors(result):
                    torch.ops._c10d_functional.wait_tensor(t)
        fresh = _tensors(result)
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
        if func.namespace in (_C10D, _FUNCTIONAL):
            out = _record_collective(func, args, kwargs)
        else:
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
