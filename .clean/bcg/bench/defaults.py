"""What a flag left out becomes on each kind of machine, for every command: plain data, no torch, so ``bcg bench
--help`` (which shows these defaults "on CUDA" and "on the CPU" side by side) reads them without the seconds
``import torch`` takes. The configs (:mod:`.config`, :mod:`.load_config`) pick one set per run in ``resolved()``.

Example:
    >>> CPU_DEFAULTS.model, CUDA_DEFAULTS.tc_compiler, LOAD_CPU_DEFAULTS.rates
    ('tiny-dense', 'inductor', (10.0, 40.0))
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ANALYZE_BACKENDS", "ANALYZE_RUNS", "ANALYZE_WARMUP", "CPU_DEFAULTS", "CUDA_DEFAULTS", "LOAD_CPU_DEFAULTS",
           "LOAD_CUDA_DEFAULTS", "MACHINE_CACHE_MODES", "RUNS", "TC_COMPILERS", "WARMUP", "LoadDefaults",
           "MachineDefaults"]

RUNS, WARMUP = 20, 5
# bcg analyze's: the host times stop once settled anyway, and every H200 validation of the predictions (whose errors
# the replay fixture checks) ran with these; twice the runs cost about 2 s of the 5 s prediction target.
ANALYZE_RUNS, ANALYZE_WARMUP = 10, 3
# What bcg analyze does with the machine's costs cached on disk (bcg.bench.machine_cache): read them where they match
# (and measure and keep them where none do), measure them again and overwrite, or neither read nor write.
MACHINE_CACHE_MODES = ("use", "refresh", "off")
# What compiles tc_piecewise's pieces (--tc-compiler): Inductor's generated kernels, or dynamo's trace run as it is.
TC_COMPILERS = ("inductor", "traced")


@dataclass(frozen=True)
class MachineDefaults:
    """What a ``None`` field of bench, analyze and verify becomes on one kind of machine (``threads=None``: torch's own
    default)."""

    model: str
    backends: tuple[str, ...]
    lengths: tuple[int, ...]
    chunked_prefill_size: int
    length: int
    threads: int | None
    tc_compiler: str  # what compiles tc_piecewise's pieces (bcg.bench.config_base.tc_compiler_for)


# The variants of bcg/bench/variants.py: plain torch ops unless "+fused", uncompiled unless "+inductor", islands only
# unless "+full" (breakable+fused+full is the engine's default on CUDA).
CUDA_DEFAULTS = MachineDefaults("llama-dense", ("eager", "breakable", "breakable+fused", "breakable+fused+full",
                                                "breakable+inductor", "full", "tc_piecewise"),
                                (64, 128, 256, 512, 1024, 2048), 2048, 512, None, "inductor")
# One thread: two threads on two shared cores wait on each other whenever a neighbour is busy, and the timings
# swing by an order of magnitude; one thread is slower but repeatable. A 256-token chunk keeps the emulated ladder
# to 22 captures. The CPU emulation cannot run Inductor's generated code inside a graph, so tc_piecewise's pieces are
# dynamo's trace there.
CPU_DEFAULTS = MachineDefaults("tiny-dense", ("eager", "breakable"), (16, 32, 64, 128), 256, 64, 1, "traced")

# The variants bcg analyze predicts by default (eager, and eager on the fused kernels when a +fused variant is
# asked, are always measured: they are the baseline and every graph variant's fallback).
ANALYZE_BACKENDS = {"cuda": ("breakable", "breakable+fused", "full", "tc_piecewise", "breakable+inductor"),
                    "cpu": ("breakable", "full", "tc_piecewise")}


@dataclass(frozen=True)
class LoadDefaults:
    """What a ``None`` field of :class:`~bcg.bench.load_config.LoadConfig` becomes on one kind of machine."""

    backends: tuple[str, ...]
    rates: tuple[float, ...]
    duration: float
    lengths: str
    max_wait: float


# CUDA: the issue-22 workload (Poisson arrivals, lognormal lengths of median 180 in 16..4000). CPU: a smoke test
# that takes seconds; its times measure the emulation.
LOAD_CUDA_DEFAULTS = LoadDefaults(("eager", "breakable+fused+full", "full+fused", "tc_piecewise"),
                                  (100.0, 300.0, 900.0), 10.0, "lognormal:180", 5.0)
LOAD_CPU_DEFAULTS = LoadDefaults(("eager", "breakable"), (10.0, 40.0), 1.5, "lognormal:24:4:96", 2.0)
