"""A profile's events read straight from kineto's records, and one profile cut into the forwards it holds.

``prof.events()`` builds a ``FunctionEvent`` per record with its inputs, stack and children: for a profiled forward
of a 28-layer model that is most of a second of Python, paid again for every profile. :func:`profile_events` reads the
same records as light :class:`Event` objects (the fields :func:`~bcg.bench.trace.kernels_from_events` needs, and the
bytes of each allocation), about ten times faster, with the same names and times (µs from the trace's start).
``bcg analyze`` then profiles every size's forwards in one session, each inside a :func:`forward_label` range, and
:func:`split_forwards` gives each forward its own events: the host events inside its range and the device events
launched from it.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from bcg.bench.trace import is_launch  # the launch calls, as the trace parser reads them

__all__ = ["FORWARD_PREFIX", "Event", "Span", "cpu_peak_bytes", "forward_label", "profile_events", "split_forwards"]

# The range around one profiled forward: "bcg.forward:<tag>".
FORWARD_PREFIX = "bcg.forward:"
# Records FunctionEvent leaves out too (torch.autograd.profiler_util._filter_name): the record_function machinery.
_SKIPPED = frozenset({"profiler::_record_function_enter", "profiler::_record_function_enter_new",
                      "profiler::_record_function_exit", "[OutOfMemory]", "aten::is_leaf", "aten::output_nr",
                      "aten::_version"})
MEMORY = "[memory]"
# What profile_events reads of each kineto record (torch's own _KinetoEvent methods).
_READ = ("name", "device_type", "start_ns", "end_ns", "correlation_id", "linked_correlation_id", "start_thread_id",
         "is_user_annotation", "nbytes")


class Span(NamedTuple):
    """Start and end in µs (a ``FunctionEvent.time_range``'s two fields)."""

    start: float
    end: float


class Event(NamedTuple):
    """One profiler record: what :func:`~bcg.bench.trace.kernels_from_events` reads of a ``FunctionEvent``, and
    ``nbytes`` (an allocation's bytes, negative for a free; 0 for other records). A named tuple: a profile holds
    hundreds of thousands, and a tuple is made in a fifth of a frozen dataclass's time."""

    name: str
    device_type: str
    time_range: Span
    id: int = 0
    linked_correlation_id: int = 0
    thread: int = 0
    is_user_annotation: bool = False
    nbytes: int = 0


def forward_label(tag: str) -> str:
    """The range name of one profiled forward (what :func:`split_forwards` cuts at).

    Example::

        >>> forward_label("eager:512#0")
        'bcg.forward:eager:512#0'
    """
    return f"{FORWARD_PREFIX}{tag}"


@functools.lru_cache(maxsize=4096)
def _demangled(name: str) -> str:
    """A kernel's C++ name as FunctionEvent shows it (kineto records some mangled)."""
    if not name.startswith("_Z"):
        return name
    try:
        import torch

        return torch._C._demangle(name)
    except Exception:  # an old torch without the helper: the mangled name still matches within one run
        return name


def profile_events(prof: Any) -> list[Event]:
    """Every record of a stopped ``torch.profiler.profile`` as an :class:`Event`, from kineto's results where this
    torch exposes them, else from ``prof.events()`` (the same fields, slower).

    Example::

        with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
            forward()
        [e.name for e in profile_events(prof) if e.device_type == "CPU"][:3]
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    raw = results.events() if results is not None and hasattr(results, "trace_start_ns") else None
    if raw is None or (raw and not all(hasattr(raw[0], m) for m in _READ)):  # an older torch: its FunctionEvents
        return [Event(e.name, str(e.device_type).rsplit(".", 1)[-1], Span(e.time_range.start, e.time_range.end),
                      e.id, getattr(e, "linked_correlation_id", 0), e.thread,
                      bool(getattr(e, "is_user_annotation", False)),
                      int(getattr(e, "cpu_memory_usage", 0) if e.name == MEMORY else 0)) for e in prof.events()]
    t0 = results.trace_start_ns()
    hidden = bool(raw) and hasattr(raw[0], "is_hidden_event")
    out = []
    cpu = "CPU"
    for e in raw:
        name = e.name()
        if name in _SKIPPED or (hidden and e.is_hidden_event()):
            continue
        if name.startswith("aten::"):  # most records: an op on the host, read with fewer calls
            out.append(Event(name, cpu, Span((e.start_ns() - t0) / 1e3, (e.end_ns() - t0) / 1e3), e.correlation_id(),
                             0, e.start_thread_id()))
            continue
        device = str(e.device_type()).rsplit(".", 1)[-1]
        if name == MEMORY:
            start = (e.start_ns() - t0) / 1e3
            out.append(Event(name, device, Span(start, start), nbytes=int(e.nbytes())))
            continue
        out.append(Event(_demangled(name), device, Span((e.start_ns() - t0) / 1e3, (e.end_ns() - t0) / 1e3),
                         e.correlation_id(), e.linked_correlation_id(), e.start_thread_id(), e.is_user_annotation()))
    return out


def split_forwards(events: Sequence[Event]) -> dict[str, list[Event]]:
    """Each :func:`forward_label` range's events, by tag: the host records that start inside it and the device
    records launched inside it (by their launch call's correlation id; else by their start, which follows the launch:
    each forward syncs before its range closes). Records outside every range are left out.

    Example::

        >>> ev = [Event("bcg.forward:a", "CPU", Span(0, 10)), Event("aten::mm", "CPU", Span(1, 2)),
        ...       Event("bcg.forward:b", "CPU", Span(20, 30)), Event("aten::add", "CPU", Span(21, 22))]
        >>> {tag: [e.name for e in es] for tag, es in split_forwards(ev).items()}
        {'a': ['aten::mm'], 'b': ['aten::add']}
    """
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[len(FORWARD_PREFIX):]) for e in events
                    if e.device_type == "CPU" and e.name.startswith(FORWARD_PREFIX))
    starts = [r[0] for r in ranges]
    launches = {e.id: e.time_range.start for e in events if e.device_type == "CPU" and is_launch(e.name)}
    out: dict[str, list[Event]] = {r[2]: [] for r in ranges}

    def owner(t: float) -> str | None:
        i = bisect.bisect_right(starts, t) - 1
        return ranges[i][2] if i >= 0 and t <= ranges[i][1] else None

    for e in events:
        if e.name.startswith(FORWARD_PREFIX):
            continue
        t = e.time_range.start if e.device_type == "CPU" else launches.get(e.id, e.time_range.start)
        tag = owner(t)
        if tag is not None:
            out[tag].append(e)
    return out


def cpu_peak_bytes(events: Iterable[Event]) -> float | None:
    """The most host memory the allocations among ``events`` held at once above where they started (None when none
    was recorded: the profile was not asked for memory).

    Example::

        >>> mem = [Event(MEMORY, "CPU", Span(t, t), nbytes=b) for t, b in ((1, 100), (2, 50), (3, -100), (4, 20))]
        >>> cpu_peak_bytes(mem)
        150.0
    """
    deltas = sorted((e.time_range.start, e.nbytes) for e in events if e.name == MEMORY and e.device_type == "CPU")
    if not deltas:
        return None
    held = peak = 0.0
    for _, delta in deltas:
        held += delta
        peak = max(peak, held)
    return peak
