"""The arithmetic of the judgment layer: Amdahl bounds, predicted speedups and bucket coverage.

Everything here is pure (numbers in, numbers out) so it is unit-tested without a model or a GPU. Conventions
follow the seed: ``p`` is the share of time that stays eager (the islands), not the share that is sped up, so the
ceiling on any speedup of the rest is ``S_max = 1 / p``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Coverage",
    "Prediction",
    "amdahl_speedup",
    "bucket_coverage",
    "chunk_sizes",
    "implied_n",
    "interpolate",
    "island_fraction",
    "launch_gap_share",
    "launch_bound",
    "predict_breakable",
    "prediction_error",
    "s_max",
    "smallest_covering_ceiling",
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


# ------------------------------------------------------------------------------------------------ coverage
Choose = Callable[[int], tuple[int | None, str]]


def chunk_sizes(length: int, chunked_prefill_size: int) -> list[int]:
    """Forward sizes of one prompt prefilled alone: full chunks, then the remainder (as the scheduler splits).

    Example::

        >>> chunk_sizes(5000, 2048)
        [2048, 2048, 904]
    """
    if length < 1 or chunked_prefill_size < 1:
        raise ValueError(f"length and chunked_prefill_size must be >= 1, got {length}, {chunked_prefill_size}")
    full, rest = divmod(length, chunked_prefill_size)
    return [chunked_prefill_size] * full + ([rest] if rest else [])


@dataclass
class Coverage:
    """How a bucket ladder serves a prompt-length distribution (each prompt prefilled alone, chunked).

    Attributes:
        num_prompts / num_forwards: prompts given and the forwards they split into.
        graph_fraction: share of forwards that replay a graph.
        graph_token_fraction: share of real tokens that go through a replayed graph.
        padding_waste: (padded - real) / real over the forwards that replay a graph.
        reaches_chunk: whether the largest bucket is at least ``chunked_prefill_size``.
        never_fired: buckets no forward of the distribution chose.
        fired: forwards per bucket.
        eager_reasons: forwards per reason for running eagerly.
        forward_sizes: the real size of every forward (for histograms).
    """

    num_prompts: int
    num_forwards: int
    graph_fraction: float
    graph_token_fraction: float
    padding_waste: float
    reaches_chunk: bool
    max_bucket: int
    chunked_prefill_size: int
    never_fired: list[int]
    fired: dict[int, int] = field(default_factory=dict)
    eager_reasons: dict[str, int] = field(default_factory=dict)
    forward_sizes: list[int] = field(default_factory=list, repr=False)


def bucket_coverage(lengths: Iterable[int], choose: Choose, buckets: Sequence[int],
                    chunked_prefill_size: int) -> Coverage:
    """Coverage of ``lengths`` by ``buckets``, deciding replay with ``choose`` (pass ``runner.choose``).

    Using the runner's own predicate means disabled buckets and the padding limit count exactly as they will
    at serving time.

    Example::

        >>> from bcg.runtime.runner.buckets import BucketTable
        >>> table = BucketTable([16, 32, 64])
        >>> choose = lambda n: (table.choose(n).bucket, table.choose(n).reason)
        >>> cov = bucket_coverage([10, 30, 100], choose, table.sizes, chunked_prefill_size=128)
        >>> cov.graph_fraction, cov.never_fired, cov.reaches_chunk
        (0.6666666666666666, [64], False)
    """
    if not buckets:
        raise ValueError("bucket_coverage needs at least one bucket")
    lengths = list(lengths)
    if not lengths:
        raise ValueError("bucket_coverage needs at least one prompt length")
    fired: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    sizes: list[int] = []
    real_graph = padded_graph = real_total = 0
    for length in lengths:
        for n in chunk_sizes(int(length), chunked_prefill_size):
            sizes.append(n)
            real_total += n
            bucket, reason = choose(n)
            if bucket is None:
                reasons[reason] += 1
                continue
            fired[bucket] += 1
            real_graph += n
            padded_graph += bucket
    num_forwards = len(sizes)
    graph_forwards = sum(fired.values())
    return Coverage(
        num_prompts=len(lengths),
        num_forwards=num_forwards,
        graph_fraction=graph_forwards / num_forwards,
        graph_token_fraction=real_graph / real_total,
        padding_waste=(padded_graph - real_graph) / real_graph if real_graph else 0.0,
        reaches_chunk=max(buckets) >= chunked_prefill_size,
        max_bucket=max(buckets),
        chunked_prefill_size=chunked_prefill_size,
        never_fired=sorted(b for b in set(buckets) if b not in fired),
        fired=dict(sorted(fired.items())),
        eager_reasons=dict(reasons),
        forward_sizes=sizes,
    )


def smallest_covering_ceiling(forward_sizes: Iterable[int], ladder: Sequence[int],
                              chunked_prefill_size: int) -> int:
    """The smallest ladder size that covers every forward, capped at ``chunked_prefill_size``.

    No forward is larger than the chunk, so a ceiling above it only adds resident memory; a ceiling below the
    largest forward leaves that forward's eager activation peak in place (the seed's memory lesson).

    Example::

        >>> smallest_covering_ceiling([100, 300], [128, 256, 512, 1024], 2048)
        512
    """
    largest = max(forward_sizes)
    for size in sorted(ladder):
        if size >= largest:
            return min(size, chunked_prefill_size)
    return chunked_prefill_size
