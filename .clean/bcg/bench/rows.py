"""A row of ``bcg bench``: one (variant, input length, requests) measurement, and what it is compared with.

A row holds its wall time (:class:`~bcg.bench.timing.Stats` of the timed prefills), how its untimed prefill ran
(``graph_used``, ``bucket``, ``reason``) and three records filled from the rows of the same shape by
:func:`compare_with_eager`: the :class:`Speedup` over eager, the :class:`DeviceTime` (this variant's profiled device
time, the host overhead above it and the kernel floors) and the :class:`TokenCheck` of the greedy tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bcg.bench.amdahl import launch_gap_share
from bcg.bench.timing import Stats

__all__ = ["CPU_SPEEDUP_NOTE", "DeviceTime", "LatencyRow", "Shape", "Speedup", "TokenCheck", "compare_with_eager",
           "geomean_speedups"]

CPU_SPEEDUP_NOTE = ("CPU emulation: speedups measure the emulation's replay against eager on the CPU, not the "
                    "kernel-launch overhead graphs remove on a GPU")
# (variant, input length, requests): what a row measures, and the key of a profiled device time.
Shape = tuple[str, int, int]


@dataclass
class Speedup:
    """Over eager at the same shape: eager's median over this row's, and the range the two interquartile ranges
    allow (eager's q1 over this q3, eager's q3 over this q1; ``None`` for eager itself)."""

    over_eager: float
    low: float | None = None
    high: float | None = None


@dataclass
class DeviceTime:
    """Device busy time from the profiler (CUDA only; ``None`` on a CPU or with ``--no-profile``).

    Attributes:
        ms: this variant's device time, from one profiled prefill of its own engine.
        host_ms: the wall median minus ``ms``: how long the device waited for the host.
        wall_over_device: the wall median over ``ms`` (1.0: the host hides entirely behind the GPU).
        floor_ms / fused_floor_ms: eager's device time at this shape on plain torch ops and, when a variant uses
            them, on the fused kernels: the floors no launch path beats without fusing more.
        launch_gap_share: ``1 - floor_ms / wall median``, the share of this row's time the plain kernels leave idle.
    """

    ms: float | None = None
    host_ms: float | None = None
    wall_over_device: float | None = None
    floor_ms: float | None = None
    fused_floor_ms: float | None = None
    launch_gap_share: float | None = None


@dataclass
class TokenCheck:
    """The greedy tokens of the untimed prefill, whether eager's row of the same shape chose the same ones, and the
    smallest gap between eager's two best logits over its requests (a near-tie that bf16 rounding may flip)."""

    next_tokens: list[int] = field(default_factory=list)
    equal_eager: bool | None = None
    eager_top2_gap: float | None = None


@dataclass
class LatencyRow:
    """One (variant, input length, requests) measurement; times in milliseconds.

    ``graph_used`` is True when every forward of the untimed prefill replayed a graph; ``bucket``/``reason`` are
    those of its first forward.
    """

    backend: str
    input_len: int
    num_requests: int
    num_tokens: int
    wall: Stats
    graph_used: bool
    bucket: int | None
    reason: str
    speedup: Speedup | None = None
    device: DeviceTime = field(default_factory=DeviceTime)
    greedy: TokenCheck = field(default_factory=TokenCheck)

    @property
    def shape(self) -> Shape:
        return self.backend, self.input_len, self.num_requests


def compare_with_eager(rows: Sequence[LatencyRow], device_ms: Mapping[Shape, float | None] | None = None) -> None:
    """Fills every row's speedup, device time (from ``device_ms``, the profiled device time per shape, where eager's
    and ``eager+fused``'s are the floors) and greedy-token check from eager's row of the same shape.

    Example::

        compare_with_eager(result.rows, {("eager", 64, 1): 1.7})   # rows[i].speedup.over_eager, .device.floor_ms
    """
    device_ms = device_ms or {}
    eager = {(r.input_len, r.num_requests): r for r in rows if r.backend == "eager"}
    for r in rows:
        wall, ms = r.wall.median_ms, device_ms.get(r.shape)
        r.device.ms = ms
        if ms and wall > 0:
            r.device.host_ms, r.device.wall_over_device = wall - ms, wall / ms
        base = eager.get((r.input_len, r.num_requests))
        if base is None:
            continue
        r.speedup = Speedup(base.wall.median_ms / wall) if wall > 0 else None
        if r.speedup is not None and r is not base and r.wall.q1_ms > 0:
            r.speedup.low, r.speedup.high = base.wall.q1_ms / r.wall.q3_ms, base.wall.q3_ms / r.wall.q1_ms
        r.device.floor_ms = device_ms.get(base.shape)
        r.device.fused_floor_ms = device_ms.get(("eager+fused", r.input_len, r.num_requests))
        r.device.launch_gap_share = launch_gap_share(r.device.floor_ms, wall) if wall > 0 else None
        mine, theirs = r.greedy.next_tokens, base.greedy.next_tokens
        r.greedy.equal_eager = mine == theirs if mine and theirs else None
        r.greedy.eager_top2_gap = base.greedy.eager_top2_gap


def geomean_speedups(rows: Sequence[LatencyRow], backends: Sequence[str]) -> dict[str, float]:
    """Geometric mean of the one-request speedups over eager of every graph backend that has rows.

    Backends that were unavailable or refused have no rows, so nothing they would have served eagerly counts.

    Example::

        geomean_speedups(result.rows, ["eager", "breakable"])   # {"breakable": 2.41}
    """
    out: dict[str, float] = {}
    for b in backends:
        vals = [r.speedup.over_eager for r in rows if r.backend == b and r.speedup and r.speedup.over_eager]
        if b != "eager" and vals:
            out[b] = statistics.geometric_mean(vals)
    return out
