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
capture, exactly as it must on a GPU. Emulation is for correctness, not speed. What a capture refuses is decided by
:mod:`bcg.capture_rules`, which the capturability probe applies too; this file records and replays.

On CUDA, capture does not execute kernels, so tensors a segment allocates hold garbage at capture; the emulation
executes them (all but collectives, so ranks are no more coupled during a capture than on CUDA). Where that would
matter, it is made to: an eager function called at capture sees every tensor a segment of the same capture allocated
(:meth:`EmulatedGraph.fresh_storages`) poisoned (:func:`poisoned`: NaN, the largest integer), as a CUDA island sees
memory no kernel has written yet. A function that indexes with such values (``one_hot``, ``gather``, an expert loop)
fails here as it would corrupt or kill the CUDA context there; give it a ``capture_stub``. The segments themselves
keep executing on real values, so the emulation never fails where the GPU, which runs nothing at capture, does not.
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

from bcg.capture_rules import (
    _C10D,
    UncapturableOpError,
    begin_segment_capture,
    check_capturable,
    end_segment_capture,
)
from bcg.tensors import storage_key, tensor_leaves

__all__ = ["RECORDS_COMPILED_CODE", "EmulatedGraph", "emulated_pool_handle", "poison_value", "poisoned"]

aten = torch.ops.aten
_FUNCTIONAL = "_c10d_functional"
_pool_ids = itertools.count(1)


def emulated_pool_handle() -> tuple[int, int]:
    """A fresh pool id, shaped like ``torch.cuda.graph_pool_handle()``; the emulation has no memory reuse."""
    return (0, next(_pool_ids))


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
        inputs = {storage_key(t) for t in tensor_leaves(args) + tensor_leaves(list(kwargs.values()))}
        self.outputs = tensor_leaves(out)
        # Outputs that alias an input (views, in-place and out= ops) already live at the recorded address;
        # freshly allocated outputs must be copied back so later ops read them where they were captured.
        self.copy_back = [storage_key(t) not in inputs for t in self.outputs]
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
                for t in tensor_leaves(result):
                    torch.ops._c10d_functional.wait_tensor(t)
        fresh = tensor_leaves(result)
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
    def __init__(self, ops: list[_Op], fresh: set[int]) -> None:
        super().__init__()
        self.ops, self.fresh = ops, fresh

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled function called during a capture runs its compiled artifact, whose ops this mode records, as a
        # CUDA capture records the artifact's kernels; without this, torch.compile would fall back to eager Python.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_capturable(func, args, kwargs)
        if func.namespace in (_C10D, _FUNCTIONAL):
            out = _record_collective(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        op = _Op(func, args, kwargs, out)
        self.fresh.update(storage_key(t) for t, fresh in zip(op.outputs, op.copy_back) if fresh)
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
        self._fresh: set[int] = set()
        self._mode: _RecordMode | None = None
        self._token: contextvars.Token | None = None
        self._inference = False
        self._captured = False
        self._invalid: str | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._mode is not None or self._captured:
            raise RuntimeError("this EmulatedGraph was already captured; create a new one")
        self._inference = torch.is_inference_mode_enabled()
        self._mode = _RecordMode(self._ops, self._fresh)
        self._token = begin_segment_capture(self)
        _CAPTURES_UNDERWAY[id(self)] = (self, capture_error_mode, threading.get_ident())
        self._mode.__enter__()

    def capture_end(self) -> None:
        if self._mode is None:
            raise RuntimeError("capture_end() without capture_begin()")
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            _CAPTURES_UNDERWAY.pop(id(self), None)
            end_segment_capture(self._token)
            self._token = None
            self._captured = True
        if self._invalid is not None:
            # cudaStreamEndCapture fails once an illegal call invalidated the capture, even if it was caught.
            raise UncapturableOpError(f"the capture was invalidated by an earlier uncapturable operation: "
                                      f"{self._invalid}")

    def fresh_storages(self) -> set[int]:
        """Storage keys of the tensors this graph's recorded ops allocated (not views or in-place writes of tensors
        that existed before): on CUDA their contents at capture are whatever the pool held."""
        return set(self._fresh)

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
        if self._captured:
            _destroyed_during_capture(self)
        self._ops, self._fresh = [], set()
        self._captured = False
        self._invalid = None

    def __del__(self) -> None:
        if getattr(self, "_captured", False):  # a CUDAGraph's destructor resets it: the same rule applies
            _destroyed_during_capture(self)


# The emulated segments capturing now, in every thread: id -> (graph, capture_error_mode, thread).
_CAPTURES_UNDERWAY: dict[int, tuple[EmulatedGraph, str, int]] = {}


def _destroyed_during_capture(graph: EmulatedGraph) -> None:
    """A captured graph is reset or destroyed: on CUDA, cudaGraphExecDestroy is an unsafe call while a capture is
    underway (in any thread for a "global" capture, in this one for "thread_local"), and it invalidates that
    capture, whose cudaStreamEndCapture then fails. A collection of garbage in the middle of a capture does it."""
    if not _CAPTURES_UNDERWAY:  # also at interpreter exit, where the dict may already be gone
        return
    me = threading.get_ident()
    for other, mode, thread in list(_CAPTURES_UNDERWAY.values()):
        if other is graph or mode == "relaxed" or (mode == "thread_local" and thread != me):
            continue
        if other._invalid is None:
            other._invalid = ("a captured CUDA graph was reset or destroyed during this capture (a garbage "
                              "collection mid-capture does it): keep graphs alive, or reset them, outside captures")


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What an emulated island reads at capture from memory no kernel wrote: NaN, or the largest integer (an index
    out of every range)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


@contextmanager
def poisoned(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Inside the block ``tensors`` hold :func:`poison_value`; afterwards their values are back (the later segments
    of an emulated capture execute on them, where a CUDA capture executes nothing)."""
    if not tensors:
        yield
        return
    with torch.inference_mode():  # the tensors may be inference tensors (a build runs under inference mode)
        saved = [(t, t.clone()) for t in tensors]
        for t in tensors:
            t.fill_(poison_value(t.dtype))
    try:
        yield
    finally:
        with torch.inference_mode():
            for t, copy in saved:
                t.copy_(copy)
