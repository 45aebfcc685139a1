"""One profiled eager forward as the prediction model reads it: every kernel in launch order, which island call
launched it, and the op it belongs to.

:func:`kernels_from_events` turns ``torch.profiler`` events into :class:`Kernel` records. The islands are found by
the ranges :data:`ISLAND_PREFIX` annotations mark around every ``@eager_on_graph`` call of the profiled forward
(:mod:`bcg.bench.profile` puts them there with :func:`bcg.islands.observing_islands`): a kernel belongs to the island
whose range holds the host time it was launched at. On CUDA that host time is the launch call's (its correlation id
is the kernel's), else the start of the op that launched it, and the kernel's op is the innermost ``aten::`` op
around its launch; on a CPU, where nothing is launched, every leaf op that computes is a "kernel" running for its
own duration (numbers that mean nothing for launch overhead, but the same records). :func:`regions` then cuts the
forward where a breakable graph would: graph work between island calls, and each call's own kernels.

Everything here is pure, so the parsing is tested on synthetic events.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ISLAND_PREFIX", "ForwardTrace", "IslandCall", "Kernel", "Region", "combine_traces", "island_label",
           "island_names", "innermost", "is_launch", "kernels_from_events", "regions"]

# The annotation around one island call: "bcg.island:<name>#<call index>".
ISLAND_PREFIX = "bcg.island:"
# Leaf ops of a CPU trace that only make views, allocate or convert nothing: no kernel on a GPU.
_NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "empty", "empty_strided", "empty_like", "as_strided", "view", "_reshape_alias", "reshape", "slice", "select",
    "narrow", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "detach", "alias", "resolve_conj",
    "resolve_neg", "result_type", "to", "_unsafe_view", "split", "split_with_sizes", "chunk", "unbind", "lift_fresh",
    "contiguous", "size", "stride", "is_nonzero", "item", "_local_scalar_dense", "view_as", "expand_as", "unflatten",
    "flatten", "numpy_T", "movedim", "diagonal", "set_", "record_stream"))


@dataclass(frozen=True)
class Kernel:
    """One kernel of a profiled forward.

    Attributes:
        name: the kernel's name (CUDA) or its op's (CPU).
        op: the innermost ``aten::`` op it was launched from ("" when none: a Triton kernel launched from Python).
        device_us: how long it ran on the device.
        island: the island call that launched it, as ``"<name>#<index>"``; None for work a graph captures.
        is_copy: a memcpy or memset.
    """

    name: str
    op: str
    device_us: float
    island: str | None = None
    is_copy: bool = False
    host_us: float = 0.0  # when it was launched (host clock): where it falls among the island calls

    @property
    def is_triton(self) -> bool:
        """Launched from Python outside every ``aten::`` op: one of bcg's Triton kernels (not a copy)."""
        return not self.op and not self.is_copy


@dataclass(frozen=True)
class IslandCall:
    """One call of an ``@eager_on_graph`` function in the profiled forward: its name, its index among all calls and
    when it started (host clock)."""

    name: str
    index: int
    start_us: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.name}#{self.index}"


@dataclass
class ForwardTrace:
    """A forward's kernels in launch order and its island calls in call order."""

    kernels: list[Kernel]
    calls: list[IslandCall] = field(default_factory=list)

    @property
    def device_us(self) -> float:
        return sum(k.device_us for k in self.kernels)


@dataclass(frozen=True)
class Region:
    """A stretch of a forward: graph work (``island`` None), or one island call and the kernels it launched."""

    kernels: tuple[Kernel, ...]
    island: IslandCall | None = None


def island_label(name: str, index: int) -> str:
    """The annotation text of island call ``index`` of ``name`` (what :func:`kernels_from_events` reads back).

    Example::

        >>> island_label("attention_island", 3)
        'bcg.island:attention_island#3'
    """
    return f"{ISLAND_PREFIX}{name}#{index}"


def _parse_label(text: str, start_us: float) -> IslandCall:
    name, _, index = text[len(ISLAND_PREFIX):].rpartition("#")
    return IslandCall(name, int(index), start_us)


def is_launch(name: str) -> bool:
    """A CUDA runtime or driver call that puts one kernel, copy or memset on a stream (not a graph launch)."""
    if not name.startswith("cu") or "Graph" in name:
        return False
    return "Launch" in name or "Memcpy" in name or "Memset" in name


def _device(event: Any) -> str:
    return str(getattr(event, "device_type", "")).rsplit(".", 1)[-1].upper()


def _span(event: Any) -> tuple[float, float]:
    return float(event.time_range.start), float(event.time_range.end)


def innermost(intervals: Sequence[tuple[float, float, Any]], times: Sequence[float]) -> list[Any]:
    """For each time, the payload of the innermost interval holding it (None if none); intervals nest properly."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    queries = sorted(range(len(times)), key=lambda i: times[i])
    out: list[Any] = [None] * len(times)
    stack: list[tuple[float, float, Any]] = []
    j = 0
    for q in queries:
        t = times[q]
        while j < len(order) and intervals[order[j]][0] <= t:
            start, end, payload = intervals[order[j]]
            while stack and stack[-1][1] < start:
                stack.pop()
            stack.append((start, end, payload))
            j += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[q] = stack[-1][2] if stack else None
    return out


def _compute_leaves(spans: Sequence[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The ops of a CPU trace that compute and call no other op that computes: what would be one kernel each."""
    spans = sorted(spans, key=lambda s: (s[0], -s[1]))
    has_child = [False] * len(spans)
    stack: list[int] = []
    for i, (start, _, name) in enumerate(spans):
        while stack and spans[stack[-1]][1] <= start:
            stack.pop()
        if name not in _NO_KERNEL:
            for j in stack:
                has_child[j] = True
        stack.append(i)
    return [s for i, s in enumerate(spans) if s[2] not in _NO_KERNEL and not has_child[i]]


def kernels_from_events(events: Iterable[Any], cuda: bool) -> ForwardTrace:
    """The :class:`ForwardTrace` of one profiled forward from ``torch.profiler`` events (``prof.events()``).

    Each event needs ``name``, ``device_type``, ``time_range`` (``start``/``end`` in µs) and ``thread``; CUDA kernels
    also ``id`` (the correlation id their launch call shares) and, where torch records it, ``linked_correlation_id``
    (the id of the op that launched them). Island calls are the events named :func:`island_label`.

    Example::

        with torch.profiler.profile(...) as prof:
            forward()                       # islands annotated with island_label(name, index)
        trace = kernels_from_events(prof.events(), cuda=True)
        [k.island for k in trace.kernels]   # None for graph work, "attention_island#0", ...
    """
    events = list(events)
    cpu = [e for e in events if _device(e) == "CPU"]
    marks = [(*_span(e), _parse_label(e.name, _span(e)[0])) for e in cpu if e.name.startswith(ISLAND_PREFIX)]
    calls = [m[2] for m in sorted(marks, key=lambda m: m[0])]
    ops = [e for e in cpu if e.name.startswith("aten::")]
    threads = Counter(e.thread for e in ops)
    main = threads.most_common(1)[0][0] if threads else None
    ops = [e for e in ops if e.thread == main]
    op_spans = [(*_span(e), e.name) for e in ops]
    if cuda:
        launches = {e.id: _span(e)[0] for e in cpu if is_launch(e.name)}
        op_start = {e.id: _span(e)[0] for e in ops}
        # Device events of the annotations themselves (kineto's GPU-side user ranges) are not kernels.
        kernels = sorted((e for e in events if _device(e) == "CUDA" and not e.name.startswith(ISLAND_PREFIX)
                          and not getattr(e, "is_user_annotation", False)), key=lambda e: _span(e)[0])
        hosts: list[float | None] = []
        for k in kernels:
            host = launches.get(getattr(k, "id", None))
            if host is None:
                host = op_start.get(getattr(k, "linked_correlation_id", None))
            hosts.append(host)
        # A kernel whose launch was not recorded is placed at its device start (after its launch, never before).
        times = [h if h is not None else _span(k)[0] for h, k in zip(hosts, kernels)]
        names = [k.name for k in kernels]
        durations = [_span(k)[1] - _span(k)[0] for k in kernels]
        owners = innermost(op_spans, times)
        copies = ["memcpy" in n.lower() or "memset" in n.lower() for n in names]
    else:
        leaves = _compute_leaves(op_spans)
        times = [s[0] for s in leaves]
        names = owners = [s[2] for s in leaves]
        durations = [s[1] - s[0] for s in leaves]
        copies = [False] * len(leaves)
    islands = innermost([(s, e, c.label) for s, e, c in marks], times)
    order = sorted(range(len(times)), key=lambda i: times[i])
    return ForwardTrace([Kernel(names[i], owners[i] or "", durations[i], islands[i], copies[i], times[i])
                         for i in order], calls)


def regions(trace: ForwardTrace) -> list[Region]:
    """The forward cut where a breakable graph breaks: graph work, then each island call with its own kernels, in
    order. Every island call is a region, also one that launched nothing (its host work still counts); graph work
    between two calls that launched nothing is left out (no segment).

    Example::

        >>> mm = Kernel("mm", "aten::mm", 5.0)
        >>> t = ForwardTrace([mm, Kernel("sdpa", "aten::sdpa", 3.0, "attn#0", host_us=11),
        ...                   Kernel("mm", "aten::mm", 5.0, host_us=20)], [IslandCall("attn", 0, start_us=10)])
        >>> [(r.island and r.island.name, len(r.kernels)) for r in regions(t)]
        [(None, 1), ('attn', 1), (None, 1)]
    """
    by_call: dict[str, list[Kernel]] = {c.label: [] for c in trace.calls}
    starts = [c.start_us for c in trace.calls]
    graph: list[list[Kernel]] = [[] for _ in range(len(trace.calls) + 1)]  # graph work before call i, and after all
    for k in trace.kernels:
        if k.island is not None and k.island in by_call:
            by_call[k.island].append(k)
        else:
            graph[bisect.bisect_right(starts, k.host_us)].append(k)
    out: list[Region] = []
    for i, call in enumerate(trace.calls):
        if graph[i]:
            out.append(Region(tuple(graph[i])))
        out.append(Region(tuple(by_call[call.label]), call))
    if graph[-1]:
        out.append(Region(tuple(graph[-1])))
    return out


def island_names(trace: ForwardTrace) -> list[str]:
    """The distinct island names of a trace, in order of first call."""
    return list(dict.fromkeys(c.name for c in trace.calls))


def combine_traces(traces: Sequence[ForwardTrace]) -> tuple[ForwardTrace, ForwardTrace, ForwardTrace]:
    """Several profiles of the same forward as one: (median, lowest, highest) device time of each kernel, matched by
    launch order. Profiles whose kernel sequence differs from the most common one (an allocator's extra memset, say)
    are left out, so one odd forward decides nothing.

    Example::

        >>> t = [ForwardTrace([Kernel("mm", "aten::mm", us)]) for us in (9.0, 10.0, 30.0)]
        >>> [c.kernels[0].device_us for c in combine_traces(t)]
        [10.0, 9.0, 30.0]
    """
    if not traces:
        raise ValueError("combine_traces needs at least one trace")
    shape = Counter(tuple(k.name for k in t.kernels) for t in traces).most_common(1)[0][0]
    same = [t for t in traces if tuple(k.name for k in t.kernels) == shape]
    first = same[0]
    out = []
    for pick in (statistics.median, min, max):
        kernels = [dataclasses.replace(k, device_us=float(pick(t.kernels[i].device_us for t in same)))
                   for i, k in enumerate(first.kernels)]
        out.append(ForwardTrace(kernels, list(first.calls)))
    return out[0], out[1], out[2]
