"""Timing utilities: the summary of timed runs, per-step marks, and the device busy time from the profiler.

On CUDA, times come from CUDA events on the current stream (the device timeline, which includes the idle gaps
while the host is still launching: exactly the launch overhead graphs remove). On a CPU they come from
``time.perf_counter``. Every timed run starts from an idle device so runs do not queue behind each other.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FirstReplay", "GcPauses", "Marks", "Stats", "gc_pauses", "gpu_kernel_ms", "replay_span_ms", "sync",
           "time_fn"]


def sync(device: torch.device | str) -> None:
    """Waits for the device to finish queued work (a no-op on a CPU).

    Example::

        sync("cuda")   # before reading a host timer after launching kernels
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Stats:
    """Summary of timed runs in milliseconds: the median with its interquartile range (``q1_ms``-``q3_ms``, the
    spread one stray run cannot move), the extremes, the mean and the standard deviation.

    Example::

        >>> s = Stats.of([3.0, 1.0, 2.0])
        >>> s.median_ms, s.min_ms, s.q1_ms, s.q3_ms, s.runs
        (2.0, 1.0, 1.5, 2.5, 3)
    """

    median_ms: float
    min_ms: float
    q1_ms: float
    q3_ms: float
    max_ms: float
    mean_ms: float
    stdev_ms: float
    runs: int

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Stats:
        """The summary of ``samples_ms`` (at least one)."""
        xs = list(samples_ms)
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
        return cls(median_ms=statistics.median(xs), min_ms=min(xs), q1_ms=q1, q3_ms=q3, max_ms=max(xs),
                   mean_ms=statistics.fmean(xs), stdev_ms=statistics.stdev(xs) if len(xs) > 1 else 0.0, runs=len(xs))

    @property
    def spread(self) -> float | None:
        """Interquartile range over the median (0.1: the middle half of the runs spans 10%); None at a 0 median."""
        return (self.q3_ms - self.q1_ms) / self.median_ms if self.median_ms > 0 else None


def time_fn(fn: Callable[[], Any], device: torch.device | str, runs: int = 10, warmup: int = 3) -> Stats:
    """Times ``fn()`` ``runs`` times after ``warmup`` untimed calls; returns the summary of the runs.

    Example::

        t = time_fn(lambda: engine.prefill([prompt]), "cuda", runs=20, warmup=5)
        print(f"{t.median_ms:.2f} ms")
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    device = torch.device(device)
    for _ in range(max(warmup, 0)):
        fn()
    sync(device)
    samples: list[float] = []
    for _ in range(runs):
        marks = Marks(device)
        marks.mark()
        fn()
        marks.mark()
        samples.append(marks.deltas_ms()[0])
    return Stats.of(samples)


class Marks:
    """Timestamps between consecutive pieces of work; ``deltas_ms()`` gives the time of each piece.

    On CUDA each mark records an event on the current stream, so marking costs no synchronisation and the pieces
    keep overlapping with host work as they would unmarked; the one sync happens in ``deltas_ms``. The first mark
    synchronises so the first piece does not include earlier queued work.

    Example::

        marks = Marks("cuda")
        marks.mark()
        for step in handle.steps:
            step.replay() if hasattr(step, "replay") else step()
            marks.mark()
        per_step_ms = marks.deltas_ms()
    """

    def __init__(self, device: torch.device | str, capacity: int = 0) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        self._marks: list[Any] = []
        # Events made up front: creating one per mark would add host time between the pieces being timed, and
        # a host-bound sequence would then look slower than it runs unmarked.
        self._spare = [torch.cuda.Event(enable_timing=True) for _ in range(capacity)] if self.cuda else []

    def mark(self) -> None:
        if not self._marks:
            sync(self.device)
        if self.cuda:
            event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def deltas_ms(self) -> list[float]:
        if len(self._marks) < 2:
            raise ValueError("Marks.deltas_ms needs at least two marks")
        if self.cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self._marks, self._marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self._marks, self._marks[1:])]


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start_us, end_us) intervals, in ms: overlapping kernels count once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e3


def gpu_kernel_ms(fn: Callable[[], Any], device: torch.device | str, warmup: int = 1) -> float | None:
    """Device busy time of one call of ``fn`` (kernels, memcpys, memsets) from ``torch.profiler``, in ms.

    This is the floor a perfect launch path could reach: the time the GPU actually computed. Returns ``None`` on a
    CPU, or when the profiler records no device activity (e.g. CUPTI unavailable), rather than a misleading 0.
    Once used, CUPTI stays loaded in the process (kineto does not tear it down) and slows later host work, so the
    benchmarks profile only after every timed run.

    Example::

        floor = gpu_kernel_ms(lambda: engine.prefill([prompt]), "cuda")   # e.g. 2.4 (ms)
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(max(warmup, 0)):
        fn()
    sync(device)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        events = prof.events()
    except Exception:  # a profiler failure must not end a benchmark; the floor is optional
        return None
    intervals = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return _union_ms(intervals) if intervals else None


class FirstReplay:
    """While entered, calls ``callback`` once per :meth:`arm`, just before the first graph replay after it: a whole
    CUDA graph's (``torch.cuda.CUDAGraph.replay``) or a breakable graph's (its first segment's launch). A breakable
    graph's segments replay through methods bound at capture, so one replay fires once.

    Example::

        with FirstReplay(lambda: marks.append(time.perf_counter())) as first:
            first.arm()
            engine.prefill(prompts)   # marks[-1]: when the GPU got its first graph
    """

    def __init__(self, callback: Callable[[], Any]) -> None:
        self._callback = callback
        self._armed = False
        self.fired = False
        self._saved: list[tuple[Any, Any]] = []

    def arm(self) -> None:
        self._armed, self.fired = True, False

    def _wrap(self, replay: Callable[[Any], None]) -> Callable[[Any], None]:
        def replay_first(graph: Any) -> None:
            if self._armed:
                self._armed, self.fired = False, True
                self._callback()
            replay(graph)
        return replay_first

    def __enter__(self) -> FirstReplay:
        from bcg.graph import BreakableCUDAGraph

        owners: list[Any] = [BreakableCUDAGraph] + ([torch.cuda.CUDAGraph] if torch.cuda.is_available() else [])
        for owner in owners:
            self._saved.append((owner, owner.replay))
            owner.replay = self._wrap(owner.replay)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, replay in reversed(self._saved):
            owner.replay = replay
        self._saved.clear()


def replay_span_ms(fn: Callable[[], Any], device: torch.device | str, runs: int = 10) -> float | None:
    """Median device ms of ``fn``'s calls from their first graph replay to the end of the work they queued (CUDA
    events on the current stream): what the GPU took once it had a graph, the gaps between its kernels, any wait
    for an island's launch and the clock it ran at included; the host's work before the first replay left out.
    Compared with :func:`gpu_kernel_ms` (the kernels' own busy time in one profiled call) it says how much of a
    wall the device side adds beyond its kernels. ``None`` on a CPU, or when ``fn`` replays no graph.

    Example::

        span = replay_span_ms(lambda: engine.prefill([prompt]), "cuda")   # e.g. 1.02 (ms)
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spans = []
    with FirstReplay(start.record) as first:
        for _ in range(runs):
            sync(device)
            first.arm()
            fn()
            end.record()
            end.synchronize()
            if first.fired:
                spans.append(start.elapsed_time(end))
    return statistics.median(spans) if spans else None


@dataclass
class GcPauses:
    """The garbage collector's passes during a block: ``ms`` per pass, by generation (a full pass is generation 2)."""

    ms: dict[int, list[float]] = field(default_factory=lambda: {0: [], 1: [], 2: []})

    @property
    def max_ms(self) -> float:
        return max((t for v in self.ms.values() for t in v), default=0.0)

    @property
    def num_full(self) -> int:
        return len(self.ms[2])


@contextmanager
def gc_pauses() -> Iterator[GcPauses]:
    """Records every collection in the block (from any thread) and how long it held the interpreter: a pause every
    thread meets at once, so a stall a latency percentile cannot explain otherwise.

    Example::

        with gc_pauses() as pauses:
            serve()
        pauses.max_ms, pauses.num_full
    """
    pauses, began = GcPauses(), [0.0]

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.ms[info["generation"]].append((time.perf_counter() - began[0]) * 1e3)

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)
