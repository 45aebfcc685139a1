from hypothesis import given
from hypothesis import strategies as st

from bcg.runtime.scheduler import plan_batches


@given(st.lists(st.integers(1, 50), min_size=1, max_size=16), st.integers(1, 64))
def test_plan_covers_every_token_once_in_order_within_budget(lengths: list[int], chunk: int) -> None:
    batches = plan_batches(lengths, chunk)
    covered = [0] * len(lengths)
    for batch in batches:
        assert 0 < sum(c.end - c.start for c in batch) <= chunk
        assert len({c.request for c in batch}) == len(batch)  # a request at most once per batch
        for c in batch:
            assert c.start == covered[c.request]  # chunks of a request arrive in order, prefix complete
            covered[c.request] = c.end
            assert c.is_last == (c.end == lengths[c.request])
    assert covered == lengths


def test_short_prompts_share_one_batch() -> None:
    assert len(plan_batches([3, 4, 5], 16)) == 1
