"""Host times at a few sizes, the others interpolated (:mod:`bcg.bench.host_sizes`)."""

from __future__ import annotations

import pytest

from bcg.bench.host_sizes import interpolate, timed_sizes
from bcg.bench.predict import HostTimes


def _host(n: int, scale: float) -> HostTimes:
    return HostTimes(num_tokens=n, forward_ms=10.0 * scale, host_ms=9.0 * scale, prefill_ms=11.0 * scale,
                     load_us=50.0 * scale, full_load_us=60.0 * scale, island_us={"attention_island": 24.0 * scale},
                     island_calls={"attention_island": 28}, island_bytes={"attention_island": 100.0 * n},
                     prefill_pre_us=180.0 * scale, prefill_post_us=160.0 * scale, runs=10, warmups=3)


def test_three_sizes_are_timed_over_a_wide_range_and_all_over_a_narrow_one():
    assert timed_sizes([64, 128, 256, 512, 1024, 2048]) == [64, 512, 2048]
    assert timed_sizes([2048, 64, 4096]) == [64, 2048, 4096]
    assert timed_sizes([16, 32, 64]) == [16, 64]
    assert timed_sizes([64]) == [64]


def test_an_untimed_size_lies_between_its_neighbours_in_log_tokens():
    lo, hi = _host(64, 1.0), _host(512, 2.0)
    lo.low, lo.high, hi.low, hi.high = _host(64, 0.5), _host(64, 1.5), _host(512, 1.0), _host(512, 3.0)
    out = interpolate({64: lo, 512: hi}, [64, 128, 256, 512])
    assert out[64] is lo and out[512] is hi
    t = 1 / 3  # 128 is a third of the way from 64 to 512 in log2
    assert out[128].host_ms == pytest.approx(9.0 * (1 + t))
    assert out[128].island_us["attention_island"] == pytest.approx(24.0 * (1 + t))
    assert out[128].prefill_pre_us == pytest.approx(180.0 * (1 + t))
    assert out[128].island_calls == {"attention_island": 28}
    assert out[128].island_bytes["attention_island"] == pytest.approx(100.0 * 128)  # arguments grow with tokens
    assert out[256].low.host_ms == pytest.approx(9.0 * (0.5 + 0.5 * 2 / 3))
    assert out[256].high.host_ms == pytest.approx(9.0 * (1.5 + 1.5 * 2 / 3))
    assert out[128].runs == 0 and out[128].num_tokens == 128


def test_a_missing_full_load_stays_missing_and_outside_the_range_the_nearest_stands():
    lo, hi = _host(64, 1.0), _host(512, 2.0)
    hi.full_load_us = None
    out = interpolate({64: lo, 512: hi}, [32, 128, 1024])
    assert out[128].full_load_us is None
    assert out[32].host_ms == lo.host_ms and out[1024].host_ms == hi.host_ms
    assert out[32].num_tokens == 32 and out[32].runs == 0
