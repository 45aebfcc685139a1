"""Token buckets: the ladder of captured sizes, the state of each bucket, and the replay-or-eager predicate.

The :class:`BucketTable` is the one owner of every bucket's state: its captured handle, why it is disabled, and its
build record (the :class:`BucketRecord` telemetry reports), and whether
the whole backend was refused. :meth:`BucketTable.choose` reads only that.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Bucket", "BucketChoice", "BucketRecord", "BucketTable", "default_ladder"]

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


@dataclass
class BucketRecord:
    """How one bucket was built: capture time, resident memory it added, its shape, or why it is disabled."""

    num_tokens: int
    capture_ms: float = 0.0
    memory_bytes: int = 0
    num_segments: int = 0
    num_breaks: int = 0
    disabled_reason: str | None = None
    verify_diff: float | None = None  # max |replay - eager| / max |eager| when the engine verified this bucket


@dataclass(frozen=True)
class BucketChoice:
    """The outcome of :meth:`BucketTable.choose`: a bucket to replay, or ``None`` and why not."""

    bucket: int | None
    reason: str  # "graph" when a bucket is chosen


@dataclass
class Bucket:
    """One bucket's state: its build record (``record.disabled_reason`` says why it does not replay) and the
    handle its backend captured (None until captured, and again once disabled). After a build every bucket has
    one or the other."""

    record: BucketRecord
    handle: Any = None

    @property
    def is_ready(self) -> bool:
        """Captured and not disabled: batches of this size replay it."""
        return self.handle is not None and self.record.disabled_reason is None


@dataclass
class BucketTable:
    """Bucket sizes, each bucket's state, and the replay-or-eager predicate.

    Example::

        table = BucketTable([16, 32, 64], max_padding_factor=2.0)
        table.set_handle(32, handle)
        table.choose(20)   # BucketChoice(bucket=32, reason='graph')
        table.choose(100)  # BucketChoice(bucket=None, reason='exceeds_max_bucket')
    """

    sizes: list[int]
    max_padding_factor: float = 2.0
    refused_reason: str | None = None  # the backend cannot capture this model: every batch runs eagerly
    buckets: dict[int, Bucket] = field(init=False)

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("the bucket list is empty: give at least one token count")
        bad = [s for s in self.sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(f"bucket sizes must be positive ints, got {bad}")
        self.sizes = sorted(set(self.sizes))
        self.buckets = {n: Bucket(BucketRecord(num_tokens=n)) for n in self.sizes}

    @property
    def max_bucket(self) -> int:
        return self.sizes[-1]

    @property
    def handles(self) -> dict[int, Any]:
        """Handles of the buckets that replay, by size."""
        return {n: b.handle for n, b in self.buckets.items() if b.is_ready}

    def record(self, bucket: int) -> BucketRecord:
        """The build record of ``bucket``."""
        return self.buckets[bucket].record

    def set_handle(self, bucket: int, handle: Any) -> None:
        """Bucket ``bucket`` was captured: batches of its size replay ``handle`` from now on."""
        entry = self.buckets[bucket]
        entry.handle, entry.record.disabled_reason = handle, None

    def disable(self, bucket: int, reason: str) -> None:
        """Stops replaying ``bucket`` (its batches run eagerly) and records why; its handle is dropped."""
        entry = self.buckets[bucket]
        entry.handle, entry.record.disabled_reason = None, reason

    def refuse(self, reason: str) -> None:
        """The backend cannot capture this model: every bucket is disabled with ``reason``."""
        self.refused_reason = reason
        for n in self.sizes:
            self.disable(n, reason)

    def choose(self, num_tokens: int) -> BucketChoice:
        """Smallest bucket >= ``num_tokens``, unless the batch must run eagerly (the only such predicate)."""
        if self.refused_reason is not None:
            return BucketChoice(None, "backend_refused")
        if num_tokens > self.max_bucket:
            return BucketChoice(None, "exceeds_max_bucket")
        bucket = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        if bucket > self.max_padding_factor * num_tokens:
            return BucketChoice(None, "padding_over_limit")
        if self.buckets[bucket].record.disabled_reason is not None:
            return BucketChoice(None, "bucket_disabled")
        return BucketChoice(bucket, "graph")
