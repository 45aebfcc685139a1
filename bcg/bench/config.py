"""Configuration of ``bcg bench`` and ``bcg analyze``: one dataclass each, its fields named like the CLI flags.

Fields left ``None`` take a device-dependent default in :meth:`BenchConfig.resolved` /
:meth:`AnalyzeConfig.resolved`, the same for both commands (:data:`CUDA_DEFAULTS`, :data:`CPU_DEFAULTS`): on
CUDA the paper-sized ``llama-dense`` sweep, without CUDA a small ``tiny-dense`` run under the CPU emulation that
finishes in seconds, on one torch thread so its timings hold still on a shared machine. Validation raises ``ValueError``
with a message the CLI prints as a usage error; :class:`BenchError` is a run that could not measure anything.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from bcg.bench.checks import check_device, check_dtype, check_model, read_lengths_file

__all__ = ["AnalyzeConfig", "BenchConfig", "BenchError", "CPU_DEFAULTS", "CUDA_DEFAULTS", "MAX_CHUNK",
           "MAX_LENGTH", "MachineDefaults", "cpu_banner", "default_device", "machine_defaults"]

# Bounds on what one flag can make a run do: a chunk of 16384 tokens is a 74-bucket ladder (a 131072-token one
# would be 298 captures), and a 128k-token prompt is a long-context request, not a typo.
MAX_CHUNK = 16384
MAX_LENGTH = 131072
RUNS, WARMUP = 20, 5


@dataclass(frozen=True)
class MachineDefaults:
    """What a ``None`` field becomes on one kind of machine (``threads=None``: torch's own default)."""

    model: str
    backends: tuple[str, ...]
    lengths: tuple[int, ...]
    chunked_prefill_size: int
    length: int
    threads: int | None


# The variants of bcg/bench/variants.py: plain torch ops unless "+fused", uncompiled unless "+inductor".
CUDA_DEFAULTS = MachineDefaults("llama-dense", ("eager", "breakable", "breakable+fused", "breakable+inductor",
                                                "full", "tc_piecewise"),
                                (64, 128, 256, 512, 1024, 2048), 2048, 512, None)
# One thread: two threads on two shared cores wait on each other whenever a neighbour is busy, and the timings
# swing by an order of magnitude; one thread is slower but repeatable. A 256-token chunk keeps the emulated ladder
# to 22 captures.
CPU_DEFAULTS = MachineDefaults("tiny-dense", ("eager", "breakable"), (16, 32, 64, 128), 256, 64, 1)


class BenchError(RuntimeError):
    """A run that could not measure what it needs (e.g. the eager baseline failed to build); exit status 1."""


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_defaults(cuda: bool) -> MachineDefaults:
    """The defaults of a CUDA machine or of the CPU emulation."""
    return CUDA_DEFAULTS if cuda else CPU_DEFAULTS


def cpu_banner(command: str, model: str, threads: int) -> str:
    """The first line a CPU run prints: what runs, how, and what its numbers cannot show.

    Example::

        >>> cpu_banner("bench", "tiny-moe", 1).startswith("bcg bench: tiny-moe on the CPU")
        True
    """
    return (f"bcg {command}: {model} on the CPU, under the CUDA-graph emulation, {threads} torch thread"
            f"{'s' if threads != 1 else ''} (--threads). CPU timings carry no kernel-launch overhead: a speedup "
            "here measures the emulation against eager, not what graphs save on a GPU. Run on a GPU for real "
            "numbers.")


def _check_counts(runs: int, warmup: int, chunk: int) -> None:
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"--chunked-prefill-size must be in [1, {MAX_CHUNK}], got {chunk}")


def _check_lengths(flag: str, lengths: list[int]) -> None:
    if not lengths:
        raise ValueError(f"{flag} is empty; give a comma-separated list such as 64,128,256")
    bad = [n for n in lengths if not 1 <= n <= MAX_LENGTH]
    if bad:
        raise ValueError(f"{flag}: {bad[0]} is outside [1, {MAX_LENGTH}] tokens")


def _check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


@dataclass
class BenchConfig:
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
    batch_requests: int = 16
    seed: int = 0
    memory: bool = True
    plots: bool = True
    profile: bool = True
    interleave: bool = False  # True: every variant alive at once, timed in turn (False: one engine at a time)
    progress: bool | None = None
    tp: int = 1  # tensor parallel ranks (EngineConfig.tp_size); > 1 runs under `torchrun --nproc-per-node tp`

    @property
    def emulated(self) -> bool:
        """True when running without CUDA (the graph backends run under the CPU emulation)."""
        return torch.device(self.device or default_device()).type != "cuda"

    def resolved(self) -> BenchConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        from bcg.bench.variants import parse_variant

        device, d, model = _resolve_machine(self.device, self.dtype, self.model, self.model_impl)
        backends = list(d.backends) if self.backends is None else self.backends
        if not backends:
            raise ValueError("--backends is empty; give e.g. eager,breakable")
        names: list[str] = []
        for b in backends:
            name = parse_variant(b).name
            if name not in names:
                names.append(name)
        lengths = list(d.lengths) if self.lengths is None else self.lengths
        _check_lengths("--lengths", lengths)
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else d.chunked_prefill_size
        _check_counts(self.runs, self.warmup, chunk)
        _check_threads(self.threads)
        if self.batch_requests < 1:
            raise ValueError(f"--batch-requests must be >= 1, got {self.batch_requests}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        return replace(self, model=model, backends=names, lengths=sorted(set(lengths)), device=device,
                       chunked_prefill_size=chunk, threads=self.threads or d.threads,
                       progress=_progress(self.progress))

    @property
    def ceiling(self) -> int:
        """Capture ceiling of every engine of a resolved config: the longest input, but never past the chunk (no
        forward is larger)."""
        longest = max(self.lengths or [1])
        return min(longest, self.chunked_prefill_size) if self.chunked_prefill_size else longest


@dataclass
class AnalyzeConfig:
    """Options of ``bcg analyze``; each field is the CLI flag of the same name.

    ``lengths`` / ``lengths_file`` give the prompt-length distribution for the coverage check (default: a seeded
    log-uniform sample of ``num_prompts`` lengths in [16, chunked_prefill_size]); ``length`` is the representative
    input length at which eager and breakable are timed (one forward, so at most the chunk and the ceiling).

    Example::

        cfg = AnalyzeConfig(model="tiny-dense", device="cpu").resolved()
    """

    model: str | None = None
    model_impl: str = "auto"
    lengths: list[int] | None = None
    lengths_file: str | None = None
    num_prompts: int = 256
    length: int | None = None
    max_tokens: int | None = None
    runs: int = RUNS
    warmup: int = WARMUP
    out: str = "out/analyze"
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    chunked_prefill_size: int | None = None
    seed: int = 0
    plots: bool = True
    progress: bool | None = None

    @property
    def emulated(self) -> bool:
        return torch.device(self.device or default_device()).type != "cuda"

    def resolved(self) -> AnalyzeConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        device, d, model = _resolve_machine(self.device, self.dtype, self.model, self.model_impl)
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else d.chunked_prefill_size
        _check_counts(self.runs, self.warmup, chunk)
        _check_threads(self.threads)
        lengths = self.lengths
        if self.lengths_file is not None:
            lengths = read_lengths_file(self.lengths_file)
        if lengths is not None:
            _check_lengths("--lengths-file" if self.lengths_file else "--lengths", lengths)
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
        return replace(self, model=model, device=device, chunked_prefill_size=chunk, lengths=lengths,
                       length=length, max_tokens=max_tokens, threads=self.threads or d.threads,
                       progress=_progress(self.progress))


def _progress(progress: bool | None) -> bool:
    # Bars redraw with carriage returns and escape codes: in a log file or a pipe they are noise.
    return sys.stderr.isatty() if progress is None else progress


def _resolve_machine(device: str | None, dtype: str | None, model: str | None,
                     model_impl: str = "auto") -> tuple[str, MachineDefaults, str]:
    """(device, this machine's defaults, model) with the defaults filled in and each checked."""
    device = device or default_device()
    check_device(device)
    check_dtype(dtype)
    d = machine_defaults(torch.device(device).type == "cuda")
    model = model or d.model
    check_model(model, model_impl)
    return device, d, model
