"""Configuration of ``bcg bench`` and ``bcg analyze`` (``bcg verify``'s is :mod:`.verify_config`, re-exported here;
``bcg load``'s :mod:`.load_config`): one dataclass each, its fields named like the CLI flags
(``--chunked-prefill-size`` is ``chunked_prefill_size``).

Fields left ``None`` take a device-dependent default in ``resolved()``, the same for every command
(:data:`~bcg.bench.defaults.CUDA_DEFAULTS`, :data:`~bcg.bench.defaults.CPU_DEFAULTS`, kept in a torch-free module so
that ``--help`` shows them without importing torch): on CUDA the paper-sized ``llama-dense`` sweep, without CUDA a
small ``tiny-dense`` run under the CPU emulation that finishes in seconds, on one torch thread so its timings hold
still on a shared machine. Validation raises ``ValueError`` with a message the CLI prints as a usage error;
:class:`BenchError` is a run that could not measure anything. ``engine_spec()`` turns a resolved config into what its
engines are built from. What every command's config shares (the device, the machine's defaults, ``--tc-compiler``) is
:mod:`.config_base`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from bcg.bench import checks
from bcg.bench.config_base import Run, default_device, resolve_machine, show_progress, spec, tc_compiler_for
from bcg.bench.defaults import (
    ANALYZE_BACKENDS,
    ANALYZE_RUNS,
    ANALYZE_WARMUP,
    CPU_DEFAULTS,
    CUDA_DEFAULTS,
    MACHINE_CACHE_MODES,
    RUNS,
    TC_COMPILERS,
    WARMUP,
    MachineDefaults,
)
from bcg.bench.verify_config import VerifyConfig

if TYPE_CHECKING:
    from bcg.bench.engines import EngineSpec

__all__ = ["ANALYZE_BACKENDS", "AnalyzeConfig", "BenchConfig", "BenchError", "CPU_DEFAULTS", "CUDA_DEFAULTS",
           "MachineDefaults", "Run", "TC_COMPILERS", "VerifyConfig", "default_device", "resolve_machine",
           "show_progress", "spec", "tc_compiler_for"]


class BenchError(RuntimeError):
    """A run that could not measure what it needs (e.g. the eager baseline failed to build); exit status 1."""


@dataclass
class BenchConfig(Run):
    """Options of ``bcg bench``; each field is the CLI flag of the same name (``--no-memory`` sets memory=False).

    Example::

        cfg = BenchConfig(backends=["eager", "breakable"], lengths=[64, 128]).resolved()
        cfg.device, cfg.chunked_prefill_size      # filled in for this machine
    """

    model: str | None = None
    model_impl: str = "auto"
    backends: list[str] | None = None  # variant names (bcg.bench.variants): "breakable", "breakable+fused", ...
    lengths: list[int] | None = None
    runs: int = RUNS
    warmup: int = WARMUP
    out: str = "out/bench"
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    chunked_prefill_size: int | None = None
    tc_compiler: str | None = None  # what compiles tc_piecewise's pieces (None: tc_compiler_for's default)
    batch_requests: int = 16
    seed: int = 0
    memory: bool = True
    plots: bool = True
    profile: bool = True
    interleave: bool = False  # True: every variant alive at once, timed in turn (False: one engine at a time)
    progress: bool | None = None
    tp: int = 1  # tensor parallel ranks (EngineConfig.tp_size); > 1 runs under `torchrun --nproc-per-node tp`

    def resolved(self) -> BenchConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        from bcg.bench.variants import parse_variant

        device, d, model, impl = resolve_machine(self.device, self.dtype, self.model, self.model_impl)
        backends = list(d.backends) if self.backends is None else self.backends
        if not backends:
            raise ValueError("--backends is empty; give e.g. eager,breakable")
        names = list(dict.fromkeys(parse_variant(b).name for b in backends))  # canonical, each once
        lengths = list(d.lengths) if self.lengths is None else self.lengths
        checks.check_lengths("--lengths", lengths)
        checks.check_context("--lengths", lengths, model, impl)
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else d.chunked_prefill_size
        checks.check_counts(self.runs, self.warmup, chunk)
        checks.check_threads(self.threads)
        if self.batch_requests < 1:
            raise ValueError(f"--batch-requests must be >= 1, got {self.batch_requests}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        return replace(self, model=model, backends=names, lengths=sorted(set(lengths)), device=device,
                       chunked_prefill_size=chunk, threads=self.threads or d.threads,
                       tc_compiler=tc_compiler_for(self.tc_compiler, d), progress=show_progress(self.progress))

    @property
    def ceiling(self) -> int:
        """Capture ceiling of every engine of a resolved config: the longest input, but never past the chunk (no
        forward is larger)."""
        longest = max(self.lengths or [1])
        return min(longest, self.chunked_prefill_size) if self.chunked_prefill_size else longest

    def engine_spec(self) -> EngineSpec:
        """What every engine of a resolved config is built from: the capture ceiling :attr:`ceiling` and a KV pool
        that holds the longest prompt (the many-request batch has the same total), however long it is."""
        return spec(self.model, device=self.device, dtype=self.dtype, seed=self.seed,
                     chunked_prefill_size=self.chunked_prefill_size, max_tokens=self.ceiling,
                     kv_tokens=max(self.lengths), tc_compiler=self.tc_compiler, progress=self.progress,
                     tp_size=self.tp, model_impl=self.model_impl)


@dataclass
class AnalyzeConfig(Run):
    """Options of ``bcg analyze``; each field is the CLI flag of the same name.

    ``lengths`` / ``lengths_file`` give the workload: the prompt lengths the recommendation is for (a file may also be
    a JSON or JSON-lines trace of requests; default: a seeded log-uniform sample of ``num_prompts`` lengths in
    [16, chunked_prefill_size]). ``predict_lengths`` are the lengths every backend is predicted (and with
    ``validate`` measured) at; ``length`` is the representative one (the Amdahl point and the ``cpu_cores`` table).
    ``backends`` are the variants predicted; ``memory_budget`` bounds the recommendation's graph memory (bytes; default
    a tenth of the free device memory on CUDA, none on a CPU). ``machine_cache`` is what happens to this machine's
    cached costs (:mod:`bcg.bench.machine_cache`): ``use``, ``refresh`` or ``off``.

    Example::

        cfg = AnalyzeConfig(model="tiny-dense", device="cpu", validate=True).resolved()
    """

    model: str | None = None
    model_impl: str = "auto"
    backends: list[str] | None = None
    lengths: list[int] | None = None
    lengths_file: str | None = None
    num_prompts: int = 256
    predict_lengths: list[int] | None = None
    length: int | None = None
    max_tokens: int | None = None
    runs: int = ANALYZE_RUNS
    warmup: int = ANALYZE_WARMUP
    out: str = "out/analyze"
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    chunked_prefill_size: int | None = None
    tc_compiler: str | None = None  # what compiles tc_piecewise's pieces (None: tc_compiler_for's default)
    memory_budget: int | None = None
    validate: bool = False
    cpu_cores: list[int] | None = None
    machine_cache: str = "use"  # MACHINE_CACHE_MODES: the costs from the disk cache, measured again, or neither
    seed: int = 0
    plots: bool = True
    progress: bool | None = None

    def resolved(self) -> AnalyzeConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        from bcg.bench.variants import parse_variant

        device, d, model, impl = resolve_machine(self.device, self.dtype, self.model, self.model_impl)
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else d.chunked_prefill_size
        checks.check_counts(self.runs, self.warmup, chunk)
        checks.check_threads(self.threads)
        lengths = self.lengths
        if self.lengths_file is not None:
            lengths = checks.read_lengths_file(self.lengths_file)
        if lengths is not None:
            checks.check_lengths("--lengths-file" if self.lengths_file else "--lengths", lengths)
            checks.check_context("--lengths-file" if self.lengths_file else "--lengths", lengths, model, impl)
        if not 1 <= self.num_prompts <= 1_000_000:
            raise ValueError(f"--num-prompts must be in [1, 1000000], got {self.num_prompts}")
        max_tokens = self.max_tokens if self.max_tokens is not None else chunk
        if not 1 <= max_tokens <= chunk:
            raise ValueError(f"--max-tokens must be in [1, {chunk}] (no forward is larger than "
                             f"--chunked-prefill-size {chunk}), got {max_tokens}")
        length = self.length if self.length is not None else min(d.length, max_tokens)
        if not 1 <= length <= max_tokens:
            raise ValueError(f"--length must be in [1, {max_tokens}] (one forward that replays a graph, so at "
                             f"most --max-tokens {max_tokens}), got {length}")
        checks.check_context("--length", [length], model, impl)
        predict = self.predict_lengths or [n for n in d.lengths if n <= chunk] or [length]
        checks.check_lengths("--predict-lengths", predict)
        too_long = [n for n in predict if n > chunk]
        if too_long:
            raise ValueError(f"--predict-lengths: {too_long[0]} tokens is more than --chunked-prefill-size {chunk} "
                             "(one forward is at most a chunk; the workload's longer prompts are added up chunk by "
                             "chunk); give lengths up to the chunk")
        checks.check_context("--predict-lengths", predict, model, impl)
        kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
        names = list(ANALYZE_BACKENDS[kind]) if self.backends is None else self.backends
        variants = list(dict.fromkeys(parse_variant(b).name for b in names))
        if not [v for v in variants if parse_variant(v).backend != "eager"]:
            raise ValueError("--backends names no graph backend; give e.g. breakable,full,tc_piecewise (eager is "
                             "always measured)")
        tc_compiler = tc_compiler_for(self.tc_compiler, d)
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"--memory-budget must be a positive size such as 2GiB, got {self.memory_budget}")
        if self.machine_cache not in MACHINE_CACHE_MODES:
            raise ValueError(f"--machine-cache must be one of {', '.join(MACHINE_CACHE_MODES)}, got "
                             f"{self.machine_cache!r}")
        if self.cpu_cores is not None:
            from bcg.bench.cores import check_cores

            checks.check_lengths("--cpu-cores", self.cpu_cores)
            check_cores(self.cpu_cores)
        return replace(self, model=model, device=device, chunked_prefill_size=chunk, lengths=lengths,
                       length=length, max_tokens=max_tokens, threads=self.threads or d.threads,
                       predict_lengths=sorted(set(predict)), backends=variants, tc_compiler=tc_compiler,
                       cpu_cores=sorted(set(self.cpu_cores)) if self.cpu_cores else None,
                       progress=show_progress(self.progress))

    def engine_spec(self) -> EngineSpec:
        """What the engines of a resolved config are built from (every graph variant's ceiling is ``max_tokens``; the
        KV pool holds the longest predicted length)."""
        return spec(self.model, device=self.device, dtype=self.dtype, seed=self.seed,
                     chunked_prefill_size=self.chunked_prefill_size, max_tokens=self.max_tokens,
                     tc_compiler=self.tc_compiler or "inductor", progress=self.progress, model_impl=self.model_impl)
