"""Per-bucket build records and per-batch replay records, readable from the engine as data."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

__all__ = ["BucketRecord", "BatchRecord", "Telemetry"]

logger = logging.getLogger("bcg")


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


@dataclass
class BatchRecord:
    """One forward: its size, the bucket replayed (None when eager) and why."""

    num_tokens: int
    num_requests: int
    bucket: int | None
    graph_used: bool
    reason: str


@dataclass
class Telemetry:
    """Everything the runner measured; same shape for every backend."""

    backend: str
    buckets: dict[int, BucketRecord] = field(default_factory=dict)
    batches: list[BatchRecord] = field(default_factory=list)  # the most recent ``max_batches`` forwards
    num_batches: int = 0  # forwards recorded in total
    max_batches: int = 100_000
    compile_ms: float = 0.0
    capture_ms: float = 0.0
    graph_memory_bytes: int = 0
    refused_reason: str | None = None
    _logged: set = field(default_factory=set, repr=False)

    def log_once(self, key: str, message: str, level: int = logging.INFO) -> None:
        """Logs ``message`` the first time ``key`` is seen (fallback reasons are logged once each)."""
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, message)

    def add_batch(self, record: BatchRecord) -> BatchRecord:
        """Records one forward; the oldest records are dropped past ``max_batches`` so a server stays bounded."""
        self.batches.append(record)
        self.num_batches += 1
        if len(self.batches) > self.max_batches:
            del self.batches[: len(self.batches) - self.max_batches]
        return record

    @property
    def num_captured(self) -> int:
        return sum(r.disabled_reason is None for r in self.buckets.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("_logged", None)
        d["buckets"] = [asdict(r) for r in self.buckets.values()]
        d["num_captured"] = self.num_captured
        return d
