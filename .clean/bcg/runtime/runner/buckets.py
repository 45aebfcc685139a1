"""Token buckets: the ladder of captured sizes, the state of each bucket, and the replay-or-eager predicate.

The :class:`BucketTable` is the one owner of every bucket's state: its captured handle, why it is disabled, its build
record and replay failures (the :class:`BucketRecord` telemetry reports), and whether the whole backend was refused.
:meth:`BucketTable.choose` reads only that.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Bucket", "BucketChoice", "BucketRecord", "BucketTable", "default_ladder"]

logger = logging.getLogger("bcg")

EAGER_FALLBACK = "serving every batch eagerly"  # a refused runner's own fallback (a warning: its graphs are gone)

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
    """How one bucket was built and how its replays went: capture time, resident memory it added, its shape, why
    it is disabled, and its replay failures (consecutive ones decide the disable, see :class:`BucketTable`)."""

    bucket: int
    capture_ms: float = 0.0
    memory_bytes: int = 0
    num_segments: int = 0
    num_breaks: int = 0
    disabled_reason: str | None = None
    verify_diff: float | None = None  # max |replay - eager| / max |eager| when the engine verified this bucket
    consecutive_failures: int = 0  # replay failures since its last good replay
    num_replay_failures: int = 0  # replay failures over the engine's life
    last_failure: str | None = None  # the latest replay error, first line


@dataclass(frozen=True)
class BucketChoice:
    """The outcome of :meth:`BucketTable.choose`: a bucket to replay, or ``None`` and why not.

    ``reason`` is "graph" for a bucket within ``max_padding_factor`` and "graph_small_padding" for one beyond the
    ratio but within ``max_padding_tokens`` padded rows; otherwise the reason the batch runs eagerly.
    """

    bucket: int | None
    reason: str


@dataclass
class Bucket:
    """One bucket's state: its build record (``record.disabled_reason`` says why it does not replay) and the
    handle its backend captured (None until captured, or when its capture failed). A bucket disabled after it was
    captured keeps its handle, so it can be re-enabled (:meth:`BucketTable.enable`) without a new capture."""

    record: BucketRecord
    handle: Any = None

    @property
    def is_ready(self) -> bool:
        """Captured and not disabled: batches of this size replay it."""
        return self.handle is not None and self.record.disabled_reason is None


def _check_policy(name: str, value: Any, minimum: float, integer: bool) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok_type or isinstance(value, bool) or math.isnan(value) or value < minimum:
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")


@dataclass
class BucketTable:
    """Bucket sizes, each bucket's state, and the replay-or-eager predicate.

    A batch of ``n`` tokens may replay bucket ``b >= n`` when the padding costs little: ``b - n <=
    max_padding_tokens`` (a few padded rows cost nothing next to eager's launches), or else ``b <=
    max_padding_factor * n`` (the ratio bounds the waste on large buckets). The table's defaults are the ratio alone;
    the engine passes its configured allowance. A replay failure counts against its bucket; ``max_replay_failures``
    in a row disable it, and a good replay resets the count.

    Example::

        table = BucketTable([16, 32, 64], max_padding_factor=2.0)
        table.set_handle(32, handle)
        table.choose(20)   # BucketChoice(bucket=32, reason='graph')
        table.choose(100)  # BucketChoice(bucket=None, reason='exceeds_max_bucket')
    """

    sizes: list[int]
    max_padding_factor: float = 2.0
    max_padding_tokens: int = 0
    max_replay_failures: int = 3
    refused_reason: str | None = None  # the backend cannot capture this model: every batch runs eagerly
    # What serves the batches once the backend is refused, for its log line: the runner's own eager step, or (the
    # whole-step graphs of a breakable runner) the breakable graphs, an expected outcome logged at info level.
    fallback: str = EAGER_FALLBACK
    buckets: dict[int, Bucket] = field(init=False)

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("the bucket list is empty: give at least one token count")
        bad = [s for s in self.sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(f"bucket sizes must be positive ints, got {bad}")
        _check_policy("max_padding_factor", self.max_padding_factor, 1.0, integer=False)
        _check_policy("max_padding_tokens", self.max_padding_tokens, 0, integer=True)
        _check_policy("max_replay_failures", self.max_replay_failures, 1, integer=True)
        self.sizes = sorted(set(self.sizes))
        self.buckets = {b: Bucket(BucketRecord(bucket=b)) for b in self.sizes}

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

    def entry(self, bucket: int) -> Bucket:
        """The state of ``bucket``; a ValueError naming the sizes if there is no such bucket."""
        entry = self.buckets.get(bucket)
        if entry is None:
            raise ValueError(f"no bucket {bucket!r}; the buckets are {self.sizes}")
        return entry

    def set_handle(self, bucket: int, handle: Any) -> None:
        """Bucket ``bucket`` was captured: batches of its size replay ``handle`` from now on."""
        entry = self.buckets[bucket]
        entry.handle, entry.record.disabled_reason = handle, None
        entry.record.consecutive_failures = 0

    def disable(self, bucket: int, reason: str) -> None:
        """Stops replaying ``bucket`` (its batches run eagerly or move up the ladder), records why and logs it."""
        self.buckets[bucket].record.disabled_reason = reason
        logger.warning("bcg: bucket %d disabled: %s", bucket, reason)

    def enable(self, bucket: int) -> None:
        """Replays ``bucket``'s captured graph again (after a transient fault); its failure count starts over.

        Raises:
            ValueError: no such bucket, the backend was refused, or the bucket has no graph (its capture failed).
        """
        entry = self.entry(bucket)
        if self.refused_reason is not None:
            raise ValueError(f"bucket {bucket} cannot be enabled: {self.refused_reason}")
        if entry.handle is None:
            raise ValueError(f"bucket {bucket} has no captured graph ({entry.record.disabled_reason}); "
                             "recapture it instead (Engine.recapture / Runner.recapture)")
        entry.record.disabled_reason = None
        entry.record.consecutive_failures = 0

    def refuse(self, reason: str) -> None:
        """The backend cannot capture this model: every bucket is disabled with ``reason`` and its handle dropped."""
        self.refused_reason = reason
        for entry in self.buckets.values():
            entry.handle, entry.record.disabled_reason = None, reason
        level = logging.WARNING if self.fallback == EAGER_FALLBACK else logging.INFO
        logger.log(level, "bcg: %s; %s", reason, self.fallback)

    def count_failure(self, bucket: int, error: str) -> bool:
        """Counts a failed replay of ``bucket``; returns True when this failure disabled it (the
        ``max_replay_failures``-th in a row; logged)."""
        record = self.buckets[bucket].record
        record.consecutive_failures += 1
        record.num_replay_failures += 1
        record.last_failure = error
        if record.consecutive_failures < self.max_replay_failures or record.disabled_reason is not None:
            return False
        runs = f" ({record.consecutive_failures} replays in a row)" if record.consecutive_failures > 1 else ""
        self.disable(bucket, f"replay failed{runs}: {error}")
        return True

    def count_success(self, bucket: int) -> None:
        """A good replay of ``bucket``: its consecutive failures start over."""
        record = self.buckets[bucket].record
        if record.consecutive_failures:
            record.consecutive_failures = 0

    def padding_reason(self, bucket: int, num_tokens: int) -> str | None:
        """"graph" or "graph_small_padding" when ``num_tokens`` may be padded to ``bucket``, else None."""
        if bucket <= self.max_padding_factor * num_tokens:
            return "graph"
        if bucket - num_tokens <= self.max_padding_tokens:
            return "graph_small_padding"
        return None

    def choose(self, num_tokens: int) -> BucketChoice:
        """The smallest healthy bucket that fits ``num_tokens`` within the padding rule, or why the batch must run
        eagerly (the only such predicate). A disabled bucket is skipped for the next one up that still fits."""
        if self.refused_reason is not None:
            return BucketChoice(None, "backend_refused")
        if num_tokens > self.max_bucket:
            return BucketChoice(None, "exceeds_max_bucket")
        sizes = self.sizes
        for i in range(bisect.bisect_left(sizes, num_tokens), len(sizes)):
            bucket = sizes[i]
            reason = self.padding_reason(bucket, num_tokens)
            if reason is None:  # larger buckets pad more: none fits
                first = sizes[bisect.bisect_left(sizes, num_tokens)]
                return BucketChoice(None, "padding_over_limit" if bucket == first else "bucket_disabled")
            if self.buckets[bucket].record.disabled_reason is None:
                return BucketChoice(bucket, reason)
        return BucketChoice(None, "bucket_disabled")
