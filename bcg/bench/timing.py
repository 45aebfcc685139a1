"""Timing utilities: median wall time over runs, per-step marks, and GPU kernel time from the profiler.

On CUDA, times come from CUDA events on the current stream (the device timeline, which includes the idle gaps
while the host is still launching: exactly the launch overhead graphs remove). On a CPU they come from
``time.perf_counter``. Every timed run starts from an idle device so runs do not queue behind each other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Marks", "Timing", "gpu_kernel_ms", "sync", "time_fn"]


def sync(device: torch.device | str) -> None:
    """Waits for the device to finish queued work (a no-op on a CPU).

    Example::

        sync("cuda")   # before reading a host timer after launching kernels
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Samples of one timed function, in milliseconds.

    Example::

        >>> t = Timing([3.0, 1.0, 2.0])
        >>> t.median_ms, t.min_ms, t.q1_ms, t.q3_ms
        (2.0, 1.0, 1.5, 2.5)
    """

    samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def q1_ms(self) -> float:
        """First quartile: with ``q3_ms`` the interquartile range, the spread that one stray run cannot move."""
        return self._quartiles()[0]

    @property
    def q3_ms(self) -> float:
        return self._quartiles()[2]

    def _quartiles(self) -> list[float]:
        if len(self.samples_ms) < 2:
            return [self.samples_ms[0]] * 3
        return statistics.quantiles(self.samples_ms, n=4, method="inclusive")

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)

    @property
    def stdev_ms(self) -> float:
        return statistics.stdev(self.samples_ms) if len(self.samples_ms) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "q1_ms": self.q1_ms, "q3_ms": self.q3_ms,
                "max_ms": self.max_ms, "mean_ms": self.mean_ms, "stdev_ms": self.stdev_ms,
                "runs": len(self.samples_ms)}


def time_fn(fn: Callable[[], Any], device: torch.device | str, runs: int = 10, warmup: int = 3) -> Timing:
    """Times ``fn()`` ``runs`` times after ``warmup`` untimed calls; returns every sample.

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
    return Timing(samples)


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
