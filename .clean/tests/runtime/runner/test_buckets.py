import pytest

from bcg.runtime.runner.buckets import BucketChoice, BucketTable, default_ladder


def test_ladder_matches_the_documented_rungs() -> None:
    ladder = default_ladder(8192)
    assert ladder[:8] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert ladder[8:11] == [48, 64, 80]
    assert 288 in ladder and 320 in ladder and 544 not in ladder and 576 in ladder
    assert 1280 in ladder and 1536 in ladder and 4096 in ladder and 4608 in ladder and 8192 in ladder
    assert len(default_ladder(2048)) == 42 and len(default_ladder(4096)) == 50


@pytest.mark.parametrize("ceiling", [1, 5, 33, 600, 2047, 5000])
def test_ladder_is_capped_and_always_includes_the_ceiling(ceiling: int) -> None:
    ladder = default_ladder(ceiling)
    assert ladder[-1] == ceiling and all(b <= ceiling for b in ladder)
    assert ladder == sorted(set(ladder))


def test_ladder_rejects_nonpositive_ceiling() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        default_ladder(0)


def test_choose_picks_smallest_bucket_and_each_eager_reason() -> None:
    table = BucketTable([8, 16, 64])
    assert table.choose(1) .bucket is None and table.choose(1).reason == "padding_over_limit"
    assert table.choose(5).bucket == 8
    assert table.choose(16).bucket == 16
    assert table.choose(17).reason == "padding_over_limit"  # 64 > 2 * 17
    assert table.choose(40).bucket == 64
    assert table.choose(65).reason == "exceeds_max_bucket"
    table.disable(64, "capture failed")
    assert table.choose(40).reason == "bucket_disabled"


def test_padding_factor_is_configurable() -> None:
    assert BucketTable([64], max_padding_factor=100.0).choose(1).bucket == 64


@pytest.mark.parametrize("sizes", [[], [0, 4], [4.5]])
def test_bad_bucket_lists_are_rejected(sizes: list) -> None:
    with pytest.raises(ValueError):
        BucketTable(sizes)


def test_a_small_absolute_padding_replays_even_past_the_ratio() -> None:
    table = BucketTable([4, 8, 16, 64, 256], max_padding_factor=2.0, max_padding_tokens=8)
    assert table.choose(1) == BucketChoice(4, "graph_small_padding")  # 3 padded rows: cheaper than eager
    assert table.choose(3) == BucketChoice(4, "graph")  # within the ratio
    assert table.choose(9) == BucketChoice(16, "graph")
    assert table.choose(17) == BucketChoice(None, "padding_over_limit")  # 47 rows and 3.8x: the ratio bounds it
    assert table.choose(100) == BucketChoice(None, "padding_over_limit")
    assert table.choose(200) == BucketChoice(256, "graph")


def test_choose_moves_up_past_a_disabled_bucket_within_the_padding_rule() -> None:
    table = BucketTable([8, 16, 32, 64])
    table.disable(16, "replay failed")
    assert table.choose(12) == BucketChoice(None, "bucket_disabled")  # 32 > 2 * 12
    assert table.choose(16) == BucketChoice(32, "graph")  # the next healthy bucket that fits
    table.disable(32, "replay failed")
    assert table.choose(16) == BucketChoice(None, "bucket_disabled")
    assert BucketTable([8, 16, 32], max_padding_tokens=64).choose(5) == BucketChoice(8, "graph")


def test_replay_failures_disable_a_bucket_only_when_consecutive() -> None:
    table = BucketTable([8, 16], max_replay_failures=3)
    assert table.count_failure(16, "RuntimeError: flaky") is False
    assert table.count_failure(16, "RuntimeError: flaky") is False
    table.count_success(16)  # a good replay resets the count
    assert table.record(16).consecutive_failures == 0 and table.record(16).num_replay_failures == 2
    assert [table.count_failure(16, "RuntimeError: flaky") for _ in range(3)] == [False, False, True]
    rec = table.record(16)
    assert rec.disabled_reason is not None and "3 replays in a row" in rec.disabled_reason
    assert rec.num_replay_failures == 5 and rec.last_failure == "RuntimeError: flaky"
    assert table.choose(16) == BucketChoice(None, "bucket_disabled")


@pytest.mark.parametrize("kwargs", [{"max_padding_tokens": -1}, {"max_replay_failures": 0},
                                    {"max_padding_factor": float("nan")}])
def test_bad_table_policies_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        BucketTable([8], **kwargs)
