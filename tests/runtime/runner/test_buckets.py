import pytest

from bcg.runtime.runner.buckets import BucketTable, default_ladder


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
