"""What ``bcg analyze`` measured, as :func:`~bcg.bench.findings.findings` computes from it: host times per core
count, profiled forwards, the machine's costs, the workload and the engine's settings, optionally the validation.
Tests build synthetic ones with known answers; :mod:`bcg.bench.replay` reads one back from inputs.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bcg.bench.forecast import Profiled
from bcg.bench.predict import HostTimes
from bcg.bench.recommend import Workload
from bcg.bench.validate import Measured
from bcg.runtime.runner.buckets import BucketTable, default_ladder

__all__ = ["Measurements"]


@dataclass
class Measurements:
    """Everything :func:`~bcg.bench.findings.findings` computes from.

    Attributes:
        variants: the graph variants to predict; chunk / max_tokens / length / predict_lengths as in AnalyzeConfig.
        costs: the machine's costs per core count (None: the process as it ran).
        hosts: per core count, per kernels setting ("torch", "fused"), per size: the eager forward's host times.
        profiles: per kernels setting, per size: the profiled forward (its host times are those of ``hosts[None]``).
        num_params: parameter tensors of the model (dynamo guards one each).
        padding: the engine's (max_padding_factor, max_padding_tokens); warmup: its warm-up forwards per bucket.
        budget_bytes: the graph-memory budget of the recommendation (None: none).
        measured: the validation, by variant (None without ``--validate``).
    """

    variants: list[str]
    chunk: int
    max_tokens: int
    length: int
    predict_lengths: list[int]
    workload: Workload
    costs: dict[int | None, Any]
    hosts: dict[int | None, dict[str, dict[int, HostTimes]]]
    profiles: dict[str, dict[int, Profiled]]
    num_params: int
    emulated: bool
    tc_compiler: str
    padding: tuple[float, int] = (2.0, 64)
    warmup: int = 2
    budget_bytes: float | None = None
    measured: dict[str, Measured] | None = None
    cores: list[int] = field(default_factory=list)

    def bucket(self, n: int) -> int | None:
        """The bucket a forward of ``n`` tokens replays with the run's default ladder (None: it runs eagerly)."""
        return BucketTable(default_ladder(self.max_tokens), *self.padding).choose(n).bucket

    def lengths(self) -> list[int]:
        """The lengths predicted (and validated): ``predict_lengths`` and the representative ``length``."""
        return sorted({*self.predict_lengths, self.length})

    def sizes(self) -> list[int]:
        """The sizes to profile: every predicted length and the buckets they replay."""
        wanted = set(self.lengths())
        return sorted(wanted | {b for n in wanted if (b := self.bucket(n)) is not None})
