"""Token buckets: the ladder of captured sizes and the one predicate that decides replay or eager."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["default_ladder", "BucketChoice", "BucketTable"]

# (start, stop, step) rungs, in tokens; beyond the last rung the ladder continues in steps of 512.
_RUNGS = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))


def default_ladder(max_tokens: int) -> list[int]:
    """The default bucket ladder up to ``max_tokens``, which is always included.

    4–32 step 4, 48–256 step 16, 288–512 step 32, 576–1024 step 64, 1280–4096 step 256, then step 512.

    Example::

        >>> default_ladder(40)
        [4, 8, 12, 16, 20, 24, 28, 32, 40]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [n for start, stop, step in _RUNGS for n in range(start, stop + 1, step)]
    n = 4096 + 512
    while n <= max_tokens:
        sizes.append(n)
        n += 512
    return sorted({s for s in sizes if s <= max_tokens} | {max_tokens})


@dataclass(frozen=True)
class BucketChoice:
    """The outcome of :meth:`BucketTable.choose`: a bucket to replay, or ``None`` and why not."""

    bucket: int | None
    reason: str  # "graph" when a bucket is chosen


class BucketTable:
    """Captured bucket sizes, the disabled ones, and the replay-or-eager predicate.

    Example::

        table = BucketTable([16, 32, 64], max_padding_factor=2.0)
        table.choose(20)   # BucketChoice(bucket=32, reason='graph')
        table.choose(100)  # BucketChoice(bucket=None, reason='exceeds_max_bucket')
    """

    def __init__(self, sizes: Sequence[int], max_padding_factor: float = 2.0) -> None:
        if not sizes:
            raise ValueError("the bucket list is empty: give at least one token count")
        bad = [s for s in sizes if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"bucket sizes must be positive ints, got {bad}")
        self.sizes = sorted(set(sizes))
        self.max_padding_factor = max_padding_factor
        self.disabled: dict[int, str] = {}

    @property
    def max_bucket(self) -> int:
        return self.sizes[-1]

    def disable(self, bucket: int, reason: str) -> None:
        self.disabled[bucket] = reason

    def choose(self, num_tokens: int) -> BucketChoice:
        """Smallest bucket >= ``num_tokens``, unless the batch must run eagerly (the only such predicate)."""
        if num_tokens > self.max_bucket:
            return BucketChoice(None, "exceeds_max_bucket")
        bucket = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        if bucket > self.max_padding_factor * num_tokens:
            return BucketChoice(None, "padding_over_limit")
        if bucket in self.disabled:
            return BucketChoice(None, "bucket_disabled")
        return BucketChoice(bucket, "graph")
