"""The recommendation of ``bcg analyze``: which backend, which capture ceiling and which buckets, for a workload and
under a graph-memory budget, from the forecasts alone.

A workload is a list of prompt lengths; each prompt is prefilled alone, split into chunks of at most
``chunked_prefill_size`` tokens (:func:`~bcg.bench.coverage.chunk_sizes`), and each chunk either replays the bucket the
runner's own rule picks (:class:`~bcg.runtime.runner.buckets.BucketTable`) or runs eagerly. Its expected latency is
the mean over prompts of the chunks' predicted latencies (the engine's per-prefill host work counted once per
prompt; a later chunk's attention over the earlier ones is not modelled).

Per graph variant the candidate ladders are tried in order of preference, and the first that fits the budget is
its option: the default ladder up to the chunk (every forward can replay), the same without the buckets this
workload never fires (same latency here, less memory, but lengths not in the workload may run eagerly), then lower
ceilings (chunk/2, chunk/4, ...), each whole and then pruned; a lower ceiling runs the larger forwards eagerly and
keeps their activation peak. Across variants, and the eager ones, the lowest expected latency wins, but every
option also has an interval (its expected latency with every measured input at the low and at the high end of its
spread): a variant whose interval reaches the fastest's, or within :data:`TIE_SHARE` of it, ties with it, and among
the tied the cheapest build wins, then the least graph memory. Graphs are recommended only when they beat eager by
:data:`~bcg.bench.verdict.PAYS_THRESHOLD`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bcg.bench.amdahl import interpolate
from bcg.bench.coverage import Coverage, bucket_coverage, chunk_sizes
from bcg.bench.forecast import Forecast
from bcg.bench.verdict import PAYS_THRESHOLD
from bcg.runtime.runner.buckets import BucketTable, default_ladder

__all__ = ["TIE_SHARE", "Option", "Recommendation", "Workload", "candidate_ladders", "eager_curve", "expected_ms",
           "recommend"]

TIE_SHARE = 0.02


@dataclass(frozen=True)
class Workload:
    """The prompt lengths a recommendation is for, and where they came from (a flag, a file, a sample)."""

    lengths: tuple[int, ...]
    source: str


@dataclass
class Option:
    """One variant with one bucket ladder on the workload: expected ms per prompt, graph memory, build time."""

    variant: str
    ceiling: int | None
    buckets: list[int]
    expected_ms: float
    graph_memory_bytes: float = 0.0
    build_ms: float = 0.0
    fits: bool = True
    pruned: bool = False
    coverage: Coverage | None = field(default=None, repr=False)
    low_ms: float = float("nan")  # expected_ms with every input at the low / high end of its spread
    high_ms: float = float("nan")

    def bounds(self) -> tuple[float, float]:
        """(low, high) expected ms; the point value where no interval was computed."""
        low = self.expected_ms if self.low_ms != self.low_ms else self.low_ms  # NaN: none
        high = self.expected_ms if self.high_ms != self.high_ms else self.high_ms
        return min(low, self.expected_ms), max(high, self.expected_ms)


@dataclass
class Recommendation:
    """What to run: ``backend`` (a variant name), ``ceiling`` (``max_tokens``; None for eager) and ``buckets``, with
    its expected latency per prompt, eager's, the graph memory and build time, the budget, and why."""

    backend: str
    ceiling: int | None
    buckets: list[int]
    expected_ms: float
    eager_ms: float
    graph_memory_bytes: float
    build_ms: float
    budget_bytes: float | None
    reason: str
    options: list[Option] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.expected_ms if self.expected_ms > 0 else float("nan")


def _choose(buckets: Sequence[int], padding: tuple[float, int]) -> Callable[[int], tuple[int | None, str]]:
    table = BucketTable(list(buckets), padding[0], padding[1])

    def choose(n: int) -> tuple[int | None, str]:
        c = table.choose(n)
        return c.bucket, c.reason

    return choose


def expected_ms(workload: Workload, chunk: int, replay: Callable[[int], float], eager: Callable[[int], float],
                overhead: Callable[[int], float], choose: Callable[[int], tuple[int | None, str]] | None) -> float:
    """Mean predicted latency per prompt: each chunk ``replay(bucket)`` or ``eager(n)`` (both one prefill's worth,
    including ``overhead(n)`` ms of the engine's own host work, counted once per prompt).

    Example::

        >>> w = Workload((100, 300), "--lengths")
        >>> expected_ms(w, 256, replay=lambda b: 1.0, eager=lambda n: 5.0, overhead=lambda n: 0.5,
        ...             choose=lambda n: (256, "graph") if n <= 256 else (None, "exceeds_max_bucket"))
        1.25
    """
    total = 0.0
    for length in workload.lengths:
        chunks = chunk_sizes(length, chunk)
        for n in chunks:
            bucket = choose(n)[0] if choose is not None else None
            total += replay(bucket) if bucket is not None else eager(n)
        total -= (len(chunks) - 1) * overhead(chunks[-1])
    return total / len(workload.lengths)


def candidate_ladders(chunk: int, forward_sizes: Sequence[int], choose_of: Callable[[list[int]], Any]
                      ) -> list[tuple[int, list[int], bool]]:
    """(ceiling, buckets, pruned) in order of preference (see the module doc)."""
    ceilings = []
    c = chunk
    while c >= 16 and len(ceilings) < 5:
        ladder = default_ladder(chunk)
        snapped = max((b for b in ladder if b <= c), default=c)
        if snapped not in ceilings:
            ceilings.append(snapped)
        c //= 2
    out: list[tuple[int, list[int], bool]] = []
    for ceiling in ceilings:
        ladder = default_ladder(ceiling)
        out.append((ceiling, ladder, False))
        fired = {choose_of(ladder)(n)[0] for n in forward_sizes}
        pruned = [b for b in ladder if b in fired or b == ceiling]
        if pruned != ladder:
            out.append((ceiling, pruned, True))
    return out


def recommend(workload: Workload, chunk: int, forecasts: Sequence[Forecast], eager: dict[str, Callable[[int], float]],
              overhead: Callable[[int], float], kernels_of: Callable[[str], str], memory_of: Callable[..., float],
              build_of: Callable[..., float], padding: tuple[float, int], budget_bytes: float | None,
              eager_bounds: dict[str, tuple[Callable[[int], float], Callable[[int], float]]] | None = None
              ) -> Recommendation:
    """The recommendation for ``workload`` (see the module doc).

    Args:
        forecasts: the graph variants' forecasts (unavailable ones are skipped).
        eager: per eager variant ("eager", "eager+fused"), its prefill latency at ``n`` tokens (ms).
        overhead: the engine's host work per prefill at ``n`` tokens (ms).
        kernels_of: the eager variant whose latency a graph variant's eager forwards have.
        memory_of / build_of: ``(forecast, buckets) -> bytes / ms``.
        padding: the engine's (max_padding_factor, max_padding_tokens).
        budget_bytes: the most graph memory allowed; None for no limit.
        eager_bounds: per eager variant, its (low, high) latency curves (the spread of its runs); None: no interval.

    Example::

        rec = recommend(workload, 2048, forecasts, {"eager": eager_ms}, overhead, lambda v: "eager", memory, build,
                        (2.0, 64), budget_bytes=2 * 2**30)
        rec.backend, rec.ceiling, len(rec.buckets)
    """
    sizes = [n for length in workload.lengths for n in chunk_sizes(length, chunk)]
    bounds = eager_bounds or {name: (curve, curve) for name, curve in eager.items()}
    options: list[Option] = []
    for name, curve in eager.items():
        o = Option(name, None, [], expected_ms(workload, chunk, curve, curve, overhead, None))
        o.low_ms, o.high_ms = (expected_ms(workload, chunk, c, c, overhead, None) for c in bounds[name])
        options.append(o)
    for fc in forecasts:
        if not fc.available:
            continue
        eager_curve = eager[kernels_of(fc.variant)]
        eager_low, eager_high = bounds[kernels_of(fc.variant)]
        chosen: Option | None = None
        for ceiling, buckets, pruned in candidate_ladders(chunk, sizes, lambda b: _choose(b, padding)):
            memory = memory_of(fc, buckets)
            fits = budget_bytes is None or memory <= budget_bytes
            if not fits:
                continue
            choose = _choose(buckets, padding)
            ms = expected_ms(workload, chunk, fc.replay_at, eager_curve, overhead, choose)
            chosen = Option(fc.variant, ceiling, buckets, ms, memory, build_of(fc, buckets), True, pruned,
                            bucket_coverage(workload.lengths, choose, buckets, chunk))
            chosen.low_ms = expected_ms(workload, chunk, lambda b, f=fc: f.interval_at(b)[0], eager_low, overhead,
                                        choose)
            chosen.high_ms = expected_ms(workload, chunk, lambda b, f=fc: f.interval_at(b)[1], eager_high, overhead,
                                         choose)
            break
        if chosen is None:
            ladder = default_ladder(chunk)
            chosen = Option(fc.variant, chunk, ladder, float("nan"), memory_of(fc, ladder), build_of(fc, ladder),
                            fits=False)
        options.append(chosen)
    eager_options = [o for o in options if o.ceiling is None]
    baseline = min(eager_options, key=lambda o: o.expected_ms)
    plain = next((o for o in eager_options if o.variant == "eager"), baseline)
    graphs = [o for o in options if o.ceiling is not None and o.fits]
    best = min(graphs, key=lambda o: o.expected_ms, default=None)
    if best is None:
        over = "no graph backend can run this model" if not any(o.ceiling is not None for o in options) else \
            "no graph backend fits the graph-memory budget, not even with a lower ceiling"
        return _rec(baseline, plain, budget_bytes, f"{over}; run eagerly", options)
    if baseline.expected_ms < PAYS_THRESHOLD * best.expected_ms:
        return _rec(baseline, plain, budget_bytes, f"the fastest graph backend, {best.variant}, is predicted "
                    f"{baseline.expected_ms / best.expected_ms:.2f}x eager here, under the "
                    f"{PAYS_THRESHOLD - 1:.0%} a graph must gain to pay for its capture and memory: graphs do not pay",
                    options)
    best_high = best.bounds()[1]
    close = [o for o in graphs if o.expected_ms <= best.expected_ms * (1 + TIE_SHARE) or o.bounds()[0] <= best_high]
    pick = min(close, key=lambda o: (o.build_ms, o.graph_memory_bytes))
    why = "the lowest expected latency on this workload"
    if pick is not best:
        low, high = pick.bounds()
        why = (f"a tie with the fastest ({best.variant}, {best.expected_ms:.3f} ms, up to {best_high:.3f}): "
               f"{pick.expected_ms:.3f} ms ({low:.3f}-{high:.3f}) is within {TIE_SHARE:.0%} or inside the spread "
               f"of the measurements, and it builds faster ({pick.build_ms / 1e3:.1f} s against "
               f"{best.build_ms / 1e3:.1f} s) or, as fast, holds less graph memory")
    if pick.pruned or pick.ceiling != chunk:
        why += "; the ladder gives up " + ("buckets this workload never fires" if pick.ceiling == chunk else
                                            f"forwards above {pick.ceiling} tokens") + " to fit the budget"
    return _rec(pick, plain, budget_bytes, why, options)


def _rec(pick: Option, plain: Option, budget: float | None, reason: str, options: list[Option]) -> Recommendation:
    return Recommendation(pick.variant, pick.ceiling, pick.buckets, pick.expected_ms, plain.expected_ms,
                          pick.graph_memory_bytes, pick.build_ms, budget, reason, options)


def eager_curve(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """A latency curve (ms at ``n`` tokens) through measured points, interpolated."""
    pts = sorted(points)
    return lambda n: interpolate(pts, n)
