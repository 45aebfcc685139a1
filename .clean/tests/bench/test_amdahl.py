"""The arithmetic of bcg.bench.amdahl: bounds, predictions and bucket coverage."""

from __future__ import annotations

import math

import pytest

from bcg.bench import amdahl, coverage
from bcg.runtime.runner.buckets import BucketTable, default_ladder


def table_choose(sizes: list[int], factor: float = 2.0, disabled: tuple[int, ...] = ()):
    table = BucketTable(sizes, factor)
    for b in disabled:
        table.disable(b, "capture failed")

    def choose(n: int) -> tuple[int | None, str]:
        c = table.choose(n)
        return c.bucket, c.reason

    return choose, table.sizes


def test_s_max_is_one_over_p() -> None:
    assert amdahl.s_max(0.5) == 2.0
    assert amdahl.s_max(0.1) == pytest.approx(10.0)
    assert amdahl.s_max(1.0) == 1.0
    assert math.isinf(amdahl.s_max(0.0))
    with pytest.raises(ValueError, match="p must lie"):
        amdahl.s_max(1.5)


def test_amdahl_speedup_limits() -> None:
    assert amdahl.amdahl_speedup(0.0, 4.0) == pytest.approx(4.0)  # nothing stays eager: full n
    assert amdahl.amdahl_speedup(1.0, 100.0) == pytest.approx(1.0)  # everything stays eager: no gain
    # Amdahl's 1967 "most probable" sequential share of ~35% caps the speedup near 2.9x.
    assert amdahl.amdahl_speedup(0.35, 1e12) == pytest.approx(1 / 0.35)
    with pytest.raises(ValueError):
        amdahl.amdahl_speedup(0.5, 0.0)


def test_island_fraction_and_launch_gap() -> None:
    assert amdahl.island_fraction(1.0, 4.0) == 0.25
    assert amdahl.island_fraction(5.0, 4.0) == 1.0  # noise past the total is clamped
    assert amdahl.launch_gap_share(2.5, 10.0) == pytest.approx(0.75)
    assert amdahl.launch_gap_share(12.0, 10.0) == 0.0  # overlapping streams can exceed wall time
    assert amdahl.launch_gap_share(None, 10.0) is None
    with pytest.raises(ValueError):
        amdahl.island_fraction(1.0, 0.0)


def test_launch_bound_is_eager_over_kernel_time() -> None:
    assert amdahl.launch_bound(10.0, 2.5) == pytest.approx(4.0)
    # The bound and the launch-gap share say the same thing: 1 / (1 - gap).
    assert amdahl.launch_bound(10.0, 2.5) == pytest.approx(1 / (1 - amdahl.launch_gap_share(2.5, 10.0)))
    assert amdahl.launch_bound(10.0, None) is None
    with pytest.raises(ValueError, match="kernel_ms must be positive"):
        amdahl.launch_bound(10.0, 0.0)


def test_predict_breakable_sums_parts() -> None:
    pr = amdahl.predict_breakable(eager_ms=30.0, islands_ms=3.0, segments_ms=9.0, num_breaks=6, per_break_ms=0.5,
                                  outside_ms=0.0)
    assert pr.breaks_ms == 3.0
    assert pr.breakable_ms == pytest.approx(15.0)
    assert pr.speedup == pytest.approx(2.0)
    assert amdahl.prediction_error(pr.breakable_ms, 12.0) == pytest.approx(0.25)
    assert amdahl.prediction_error(9.0, 12.0) == pytest.approx(-0.25)
    with pytest.raises(ValueError):
        amdahl.predict_breakable(0.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        amdahl.predict_breakable(1.0, -1.0, 1.0)


def test_chunk_sizes_match_the_scheduler() -> None:
    from bcg.runtime.serving.batcher import plan_chunks

    for length in (1, 7, 2048, 2049, 5000):
        ours = coverage.chunk_sizes(length, 2048)
        theirs = [end - start for forward in plan_chunks([length], 2048) for _, start, end in forward]
        assert ours == theirs


def test_coverage_counts_replays_padding_and_unused_buckets() -> None:
    choose, sizes = table_choose([16, 32, 64])
    cov = coverage.bucket_coverage([10, 16, 30, 100], choose, sizes, chunked_prefill_size=128)
    # 10 -> 16, 16 -> 16, 30 -> 32; 100 exceeds the ladder and runs eagerly.
    assert cov.num_forwards == 4
    assert cov.graph_fraction == 0.75
    assert cov.graph_token_fraction == pytest.approx(56 / 156)
    assert cov.padding_waste == pytest.approx((16 + 16 + 32 - 56) / 56)
    assert cov.fired == {16: 2, 32: 1}
    assert cov.never_fired == [64]
    assert cov.eager_reasons == {"exceeds_max_bucket": 1}
    assert not cov.reaches_chunk


def test_coverage_splits_long_prompts_into_chunks() -> None:
    choose, sizes = table_choose(default_ladder(256))
    cov = coverage.bucket_coverage([600], choose, sizes, chunked_prefill_size=256)
    assert cov.forward_sizes == [256, 256, 88]
    assert cov.graph_fraction == 1.0
    assert cov.reaches_chunk


def test_coverage_respects_padding_limit_and_disabled_buckets() -> None:
    choose, sizes = table_choose([4, 64], factor=2.0, disabled=(4,))
    cov = coverage.bucket_coverage([3, 20, 40], choose, sizes, chunked_prefill_size=64)
    assert cov.eager_reasons == {"bucket_disabled": 1, "padding_over_limit": 1}
    assert cov.fired == {64: 1}
    assert cov.never_fired == [4]
    with pytest.raises(ValueError):
        coverage.bucket_coverage([], choose, sizes, 64)


def test_smallest_covering_ceiling() -> None:
    ladder = default_ladder(2048)
    assert coverage.smallest_covering_ceiling([100, 300], ladder, 2048) == 320
    assert coverage.smallest_covering_ceiling([2048, 5], ladder, 2048) == 2048
    assert coverage.smallest_covering_ceiling([9999], ladder, 2048) == 2048
