"""The arithmetic of the judgment layer: Amdahl bounds and predicted speedups (bucket coverage is
:mod:`bcg.bench.coverage`'s).

Everything here is pure (numbers in, numbers out) so it is unit-tested without a model or a GPU. Conventions
follow the seed: ``p`` is the share of time that stays eager (the islands), not the share that is sped up, so the
ceiling on any speedup of the rest is ``S_max = 1 / p``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Prediction",
    "amdahl_speedup",
    "implied_n",
    "interpolate",
    "island_fraction",
    "launch_gap_share",
    "launch_bound",
    "predict_breakable",
    "prediction_error",
    "s_max",
]


def s_max(p: float) -> float:
    """Amdahl's ceiling ``1 / p`` on the speedup when a share ``p`` of the time cannot be sped up.

    Example::

        >>> s_max(0.25)
        4.0
        >>> s_max(0.0)
        inf
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    return math.inf if p == 0.0 else 1.0 / p


def amdahl_speedup(p: float, n: float) -> float:
    """Speedup when a share ``p`` stays as it is and the rest runs ``n`` times faster: ``1 / (p + (1 - p) / n)``.

    Example::

        >>> round(amdahl_speedup(0.1, 10.0), 3)
        5.263
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    return 1.0 / (p + (1.0 - p) / n)


def implied_n(p: float, speedup: float) -> float:
    """How much faster the part that does not stay eager ran, given the overall ``speedup``: the ``n`` of
    :func:`amdahl_speedup` (``inf`` when the speedup reaches ``1 / p``: the rest took no time at all).

    Example::

        >>> round(implied_n(0.1, 5.263), 2)
        10.0
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    rest = 1.0 / speedup - p
    return math.inf if rest <= 0 else (1.0 - p) / rest


def interpolate(points: Sequence[tuple[float, float]], x: float, scale_past_end: bool = False) -> float:
    """``y`` at ``x`` on the piecewise-linear curve through ``points`` (sorted by ``x``): flat before the first point
    (a launch-bound latency does not fall with fewer tokens), the last slope (never negative) after the last, or with
    ``scale_past_end`` proportional to ``x`` there (memory that grows with the tokens).

    Example::

        >>> interpolate([(64, 2.0), (128, 3.0)], 96), interpolate([(64, 2.0), (128, 3.0)], 256)
        (2.5, 5.0)
        >>> interpolate([(64, 2.0)], 32), interpolate([(64, 2.0)], 128, scale_past_end=True)
        (2.0, 4.0)
    """
    if not points:
        raise ValueError("interpolate needs at least one point")
    pts = sorted(points)
    (x0, y0), (xn, yn) = pts[0], pts[-1]
    if x <= x0:
        return y0
    if x >= xn:
        if scale_past_end:
            return yn * x / xn if xn > 0 else yn
        if len(pts) == 1:
            return yn
        (xa, ya) = pts[-2]
        slope = max((yn - ya) / (xn - xa), 0.0) if xn > xa else 0.0
        return yn + slope * (x - xn)
    for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
        if xa <= x <= xb:
            return ya if xb == xa else ya + (yb - ya) * (x - xa) / (xb - xa)
    return yn


def island_fraction(island_ms: float, total_ms: float) -> float:
    """``p``: the share of ``total_ms`` spent in eager islands, clamped to [0, 1] (timer noise can overshoot).

    Example::

        >>> island_fraction(2.0, 8.0)
        0.25
    """
    if total_ms <= 0:
        raise ValueError(f"total_ms must be positive, got {total_ms}")
    return min(max(island_ms / total_ms, 0.0), 1.0)


def launch_gap_share(kernel_ms: float | None, wall_ms: float) -> float | None:
    """Share of the wall time the device sat idle between kernels: ``1 - kernel_ms / wall_ms``.

    ``None`` when no kernel time could be measured (CPU). Clamped at 0 because overlapping kernels on several
    streams can sum to more than the wall time.

    Example::

        >>> launch_gap_share(3.0, 12.0)
        0.75
        >>> launch_gap_share(None, 12.0) is None
        True
    """
    if kernel_ms is None:
        return None
    if wall_ms <= 0:
        raise ValueError(f"wall_ms must be positive, got {wall_ms}")
    return min(max(1.0 - kernel_ms / wall_ms, 0.0), 1.0)


def launch_bound(eager_ms: float, kernel_ms: float | None) -> float | None:
    """The most any launch path (a graph of any kind) can speed up eager without fusing kernels: the time
    eager takes over the time its kernels compute, ``eager_ms / kernel_ms``. ``None`` without a kernel time.

    Example::

        >>> launch_bound(12.0, 3.0)
        4.0
        >>> launch_bound(12.0, None) is None
        True
    """
    if kernel_ms is None:
        return None
    if kernel_ms <= 0:
        raise ValueError(f"kernel_ms must be positive, got {kernel_ms}")
    return eager_ms / kernel_ms


def prediction_error(predicted_ms: float, measured_ms: float) -> float:
    """Relative error of a predicted time: ``predicted / measured - 1`` (positive means too pessimistic).

    Example::

        >>> round(prediction_error(11.0, 10.0), 3)
        0.1
    """
    if measured_ms <= 0:
        raise ValueError(f"measured_ms must be positive, got {measured_ms}")
    return predicted_ms / measured_ms - 1.0


@dataclass(frozen=True)
class Prediction:
    """A breakable forward predicted from its parts, and how it compares with eager."""

    eager_ms: float
    outside_ms: float
    islands_ms: float
    segments_ms: float
    breaks_ms: float

    @property
    def breakable_ms(self) -> float:
        """Predicted breakable forward time: outside + islands + replayed segments + per-break overhead."""
        return self.outside_ms + self.islands_ms + self.segments_ms + self.breaks_ms

    @property
    def speedup(self) -> float:
        """Predicted speedup over eager."""
        return self.eager_ms / self.breakable_ms


def predict_breakable(eager_ms: float, islands_ms: float, segments_ms: float, num_breaks: int = 0,
                      per_break_ms: float = 0.0, outside_ms: float = 0.0) -> Prediction:
    """Predicts the breakable forward time from measured parts and its speedup over ``eager_ms``.

    ``islands_ms`` and ``segments_ms`` are the eager-island and replayed-segment times of one replay,
    ``outside_ms`` the eager work around the replay (embedding, loading the static buffers), and
    ``per_break_ms`` the extra cost of each of ``num_breaks`` breaks not already inside the step times.

    Example::

        >>> pr = predict_breakable(eager_ms=20.0, islands_ms=2.0, segments_ms=6.0, num_breaks=4,
        ...                        per_break_ms=0.25, outside_ms=1.0)
        >>> pr.breakable_ms, pr.speedup
        (10.0, 2.0)
    """
    if eager_ms <= 0:
        raise ValueError(f"eager_ms must be positive, got {eager_ms}")
    if min(islands_ms, segments_ms, per_break_ms, outside_ms) < 0 or num_breaks < 0:
        raise ValueError("times and the number of breaks must be non-negative")
    pred = Prediction(eager_ms, outside_ms, islands_ms, segments_ms, num_breaks * per_break_ms)
    if pred.breakable_ms <= 0:
        raise ValueError("the predicted breakable time is zero; nothing was measured")
    return pred
