"""Configuration of ``bcg load``: its dataclass, fields named like the CLI flags; its machine defaults are
:data:`~bcg.bench.defaults.LOAD_CUDA_DEFAULTS` and :data:`~bcg.bench.defaults.LOAD_CPU_DEFAULTS`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from bcg.bench import checks
from bcg.bench.config_base import Run, resolve_machine, show_progress, spec, tc_compiler_for
from bcg.bench.defaults import LOAD_CPU_DEFAULTS, LOAD_CUDA_DEFAULTS, LoadDefaults

if TYPE_CHECKING:
    from bcg.bench.engines import EngineSpec
    from bcg.bench.workload import LengthSpec

__all__ = ["LOAD_CPU_DEFAULTS", "LOAD_CUDA_DEFAULTS", "LoadConfig", "LoadDefaults"]


@dataclass
class LoadConfig(Run):
    """Options of ``bcg load``; each field is the CLI flag of the same name (``--no-prefix-cache`` sets
    prefix_cache=False). ``rates`` (requests per second) or ``trace`` (a file of arrival times and lengths) give the
    arrivals; ``lengths`` is a :func:`~bcg.bench.workload.parse_lengths` spec; ``max_wait`` is how long a request
    may wait for its first token before the backend counts as fallen behind that rate.

    Example::

        cfg = LoadConfig(rates=[50, 100], duration=2).resolved()
        cfg.length_spec, cfg.engine_spec().config.prefix_cache
    """

    model: str | None = None
    model_impl: str = "auto"
    backends: list[str] | None = None
    rates: list[float] | None = None
    trace: str | None = None
    duration: float | None = None
    lengths: str | None = None
    shared_prefix: int = 0
    max_wait: float | None = None
    warmup: int = 16
    out: str = "out/load"
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    chunked_prefill_size: int | None = None
    tc_compiler: str | None = None  # None: tc_compiler_for's default (inductor on CUDA, traced on the CPU)
    prefix_cache: bool = True
    schedule_policy: str = "fifo"
    seed: int = 0
    plots: bool = True
    progress: bool | None = None

    def resolved(self) -> LoadConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        from bcg.bench.variants import parse_variant
        from bcg.bench.workload import parse_lengths, read_trace
        from bcg.runtime.config import SCHEDULE_POLICIES

        device, d, model, impl = resolve_machine(self.device, self.dtype, self.model, self.model_impl)
        ld = LOAD_CUDA_DEFAULTS if torch.device(device).type == "cuda" else LOAD_CPU_DEFAULTS
        names = list(dict.fromkeys(parse_variant(b).name for b in (self.backends or ld.backends)))
        if self.trace is not None and (self.rates is not None or self.lengths is not None):
            raise ValueError("--trace gives the arrivals and lengths itself; leave out --rates and --lengths")
        rates = None if self.trace is not None else list(self.rates or ld.rates)
        if rates is not None and not all(math.isfinite(r) and 0 < r <= 1e6 for r in rates):
            raise ValueError(f"--rates must be positive requests per second (at most 1e6), got {rates}")
        duration = self.duration if self.duration is not None else (math.inf if self.trace else ld.duration)
        if not duration > 0 or (self.trace is None and not math.isfinite(duration)):
            raise ValueError(f"--duration must be a positive number of seconds, got {self.duration}")
        max_wait = self.max_wait if self.max_wait is not None else ld.max_wait
        if not (math.isfinite(max_wait) and max_wait > 0):
            raise ValueError(f"--max-wait must be a positive number of seconds, got {self.max_wait}")
        if self.trace is not None:
            longest = int(read_trace(self.trace)[1].max())
        else:
            longest = parse_lengths(self.lengths or ld.lengths).longest
        if self.shared_prefix < 0:
            raise ValueError(f"--shared-prefix must be >= 0 tokens, got {self.shared_prefix}")
        flag = "--trace" if self.trace is not None else "--lengths"
        if self.shared_prefix:
            flag += " with --shared-prefix"
        checks.check_context(flag, [longest + self.shared_prefix], model, impl)
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else d.chunked_prefill_size
        checks.check_chunk(chunk)
        checks.check_threads(self.threads)
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 requests, got {self.warmup}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        return replace(self, model=model, backends=names, rates=rates, duration=duration,
                       lengths=None if self.trace else (self.lengths or ld.lengths), max_wait=max_wait,
                       device=device, chunked_prefill_size=chunk, threads=self.threads or d.threads,
                       tc_compiler=tc_compiler_for(self.tc_compiler, d), progress=show_progress(self.progress))

    @property
    def length_spec(self) -> LengthSpec | None:
        """The parsed ``lengths`` of a resolved config (None with a trace)."""
        from bcg.bench.workload import parse_lengths

        return None if self.lengths is None else parse_lengths(self.lengths)

    def engine_spec(self) -> EngineSpec:
        """What every engine of a resolved config is built from (the ladder up to the chunk: a forward packs up to
        ``chunked_prefill_size`` tokens of many requests)."""
        return spec(self.model, device=self.device, dtype=self.dtype, seed=self.seed,
                     chunked_prefill_size=self.chunked_prefill_size, tc_compiler=self.tc_compiler,
                     progress=self.progress, model_impl=self.model_impl, prefix_cache=self.prefix_cache,
                     schedule_policy=self.schedule_policy)
