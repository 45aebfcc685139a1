"""Per-bucket build records and per-batch replay records, readable from the engine as data.

Telemetry only records: the state that decides replay or eager (each bucket's handle and disabled reason, a refused
backend) belongs to the runner's :class:`~bcg.runtime.runner.buckets.BucketTable`, which telemetry asks.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from bcg.runtime.runner.buckets import BucketRecord, BucketTable

__all__ = ["BatchRecord", "BucketRecord", "Telemetry"]

logger = logging.getLogger("bcg")


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
    """Everything the runner measured; same shape for every backend.

    ``buckets`` and ``refused_reason`` are read from the runner's bucket table (``None`` for the eager backend,
    which has no buckets).
    """

    backend: str
    table: BucketTable | None = field(default=None, repr=False)
    batches: list[BatchRecord] = field(default_factory=list)  # the most recent ``max_batches`` forwards
    num_batches: int = 0  # forwards recorded in total
    max_batches: int = 100_000
    compile_ms: float = 0.0
    capture_ms: float = 0.0
    graph_memory_bytes: int = 0
    compile_error: str | None = None  # the layer stack was asked to compile and did not (it runs uncompiled)
    attention_backend: str = ""  # the attention backend every batch runs (bcg.ops.attention)
    # Modules of a transformers model run as automatic islands ("path (Class): op at source"), and what the model
    # said about how it runs (bcg.models.hf); empty for native models.
    auto_islands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _logged: set = field(default_factory=set, repr=False)

    @property
    def buckets(self) -> dict[int, BucketRecord]:
        """Build record of every bucket, by size."""
        return {} if self.table is None else {n: b.record for n, b in self.table.buckets.items()}

    @property
    def refused_reason(self) -> str | None:
        """Why the backend serves every batch eagerly (it cannot capture this model), or None."""
        return None if self.table is None else self.table.refused_reason

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
        """Buckets that replay a graph."""
        return 0 if self.table is None else len(self.table.handles)

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in ("backend", "attention_backend", "num_batches", "max_batches", "compile_ms",
                                           "capture_ms", "graph_memory_bytes", "compile_error", "auto_islands",
                                           "notes")}
        d["batches"] = [asdict(r) for r in self.batches]
        d["buckets"] = [asdict(r) for r in self.buckets.values()]
        d["refused_reason"] = self.refused_reason
        d["num_captured"] = self.num_captured
        return d
