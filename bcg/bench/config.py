"""Configuration of ``bcg bench`` and ``bcg analyze``: one dataclass each, its fields named like the CLI flags.

Fields left ``None`` take a device-dependent default in :meth:`BenchConfig.resolved` /
:meth:`AnalyzeConfig.resolved`: on CUDA the paper-sized ``llama-dense`` sweep, without CUDA a small ``tiny-dense``
run under the CPU emulation that finishes in seconds. Validation raises ``ValueError`` with a message the CLI
prints as a usage error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

__all__ = ["AnalyzeConfig", "BenchConfig", "CPU_BANNER", "default_device", "parse_int_list", "read_lengths_file",
           "validate_model"]

CPU_BANNER = ("bcg: no CUDA device; running tiny-dense under the CPU emulation. These are CPU timings: they do "
              "not show kernel-launch overhead, so graph backends cannot win here. Run on a GPU for real numbers.")

GPU_LENGTHS = [64, 128, 256, 512, 1024, 2048]
CPU_LENGTHS = [16, 32, 64, 128]


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_int_list(text: str, what: str = "lengths") -> list[int]:
    """Parses ``"64,128, 256"`` into positive ints; raises ValueError naming the bad item.

    Example::

        >>> parse_int_list("64,128")
        [64, 128]
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty; give a comma-separated list such as 64,128,256")
    out = []
    for t in items:
        try:
            v = int(t)
        except ValueError:
            raise ValueError(f"--{what}: {t!r} is not an integer") from None
        if v < 1:
            raise ValueError(f"--{what}: {v} must be >= 1")
        out.append(v)
    return out


def validate_model(model: str) -> None:
    """Accepts a preset name or a checkpoint folder; raises ValueError listing the presets otherwise."""
    from bcg.models.config import PRESETS

    if model in PRESETS or os.path.isdir(model):
        return
    raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) and not a checkpoint folder")


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a torch device (use cuda, cuda:1 or cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is visible")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {device!r}: only cuda and cpu are supported")


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype {dtype!r}: choose bfloat16, float16 or float32")


@dataclass
class BenchConfig:
    """Options of ``bcg bench``; each field is the CLI flag of the same name (``--no-memory`` sets memory=False).

    Example::

        cfg = BenchConfig(backends=["eager", "breakable"], lengths=[64, 128]).resolved()
        cfg.device, cfg.runs      # filled in for this machine
    """

    model: str | None = None
    backends: list[str] | None = None
    lengths: list[int] | None = None
    runs: int | None = None
    warmup: int | None = None
    out: str = "out/bench"
    device: str | None = None
    dtype: str | None = None
    chunked_prefill_size: int = 2048
    batch_requests: int = 16
    seed: int = 0
    memory: bool = True
    plots: bool = True
    profile: bool = True
    progress: bool = True

    @property
    def emulated(self) -> bool:
        """True when running without CUDA (the graph backends run under the CPU emulation)."""
        return torch.device(self.device or default_device()).type != "cuda"

    def resolved(self) -> BenchConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        from bcg.runtime.config import resolve_backend

        device, cuda, model = _resolve_machine(self.device, self.dtype, self.model)
        backends = self.backends or (["eager", "breakable", "full", "tc_piecewise"] if cuda
                                     else ["eager", "breakable"])
        if not backends:
            raise ValueError("--backends is empty; give e.g. eager,breakable")
        names: list[str] = []
        for b in backends:
            name = resolve_backend(b)
            if name not in names:
                names.append(name)
        lengths = self.lengths or (GPU_LENGTHS if cuda else CPU_LENGTHS)
        if not lengths or any(n < 1 for n in lengths):
            raise ValueError(f"--lengths must be positive token counts, got {lengths}")
        runs = self.runs if self.runs is not None else (20 if cuda else 3)
        warmup = self.warmup if self.warmup is not None else (5 if cuda else 1)
        if runs < 1 or warmup < 0:
            raise ValueError(f"--runs must be >= 1 and --warmup >= 0, got {runs} and {warmup}")
        if self.chunked_prefill_size < 1 or self.batch_requests < 1:
            raise ValueError("--chunked-prefill-size and --batch-requests must be >= 1")
        return replace(self, model=model, backends=names, lengths=sorted(set(lengths)), runs=runs,
                       warmup=warmup, device=device)

    @property
    def ceiling(self) -> int:
        """Capture ceiling of every engine: the longest input, but never past the chunk (no forward is larger)."""
        return min(max(self.lengths or [1]), self.chunked_prefill_size)


@dataclass
class AnalyzeConfig:
    """Options of ``bcg analyze``; each field is the CLI flag of the same name.

    ``lengths`` / ``lengths_file`` give the prompt-length distribution for the coverage check (default: a seeded
    log-uniform sample of ``num_prompts`` lengths in [16, chunked_prefill_size]); ``length`` is the representative
    input length at which eager and breakable are timed.

    Example::

        cfg = AnalyzeConfig(model="tiny-dense", device="cpu").resolved()
    """

    model: str | None = None
    lengths: list[int] | None = None
    lengths_file: str | None = None
    num_prompts: int = 256
    length: int | None = None
    max_tokens: int | None = None
    runs: int | None = None
    warmup: int | None = None
    out: str = "out/analyze"
    device: str | None = None
    dtype: str | None = None
    chunked_prefill_size: int | None = None
    seed: int = 0
    plots: bool = True
    progress: bool = True

    @property
    def emulated(self) -> bool:
        return torch.device(self.device or default_device()).type != "cuda"

    def resolved(self) -> AnalyzeConfig:
        """A copy with every ``None`` replaced by this machine's default, validated."""
        device, cuda, model = _resolve_machine(self.device, self.dtype, self.model)
        # On a CPU a 2048-token ladder means ~40 emulated captures; 256 keeps analyze to seconds.
        chunk = self.chunked_prefill_size or (2048 if cuda else 256)
        if chunk < 1:
            raise ValueError(f"--chunked-prefill-size must be >= 1, got {chunk}")
        lengths = self.lengths
        if self.lengths_file is not None:
            lengths = read_lengths_file(self.lengths_file)
        if lengths is not None and (not lengths or any(n < 1 for n in lengths)):
            raise ValueError("--lengths must be a non-empty list of positive token counts")
        length = self.length or min(512 if cuda else 64, chunk)
        if length < 1:
            raise ValueError(f"--length must be >= 1, got {length}")
        max_tokens = self.max_tokens or chunk
        runs = self.runs if self.runs is not None else (20 if cuda else 5)
        warmup = self.warmup if self.warmup is not None else (5 if cuda else 1)
        if runs < 1 or warmup < 0 or self.num_prompts < 1:
            raise ValueError("--runs and --num-prompts must be >= 1 and --warmup >= 0")
        return replace(self, model=model, device=device, chunked_prefill_size=chunk, lengths=lengths,
                       length=length, max_tokens=max_tokens, runs=runs, warmup=warmup)


def _resolve_machine(device: str | None, dtype: str | None, model: str | None) -> tuple[str, bool, str]:
    """(device, is_cuda, model) with this machine's defaults filled in and each checked."""
    device = device or default_device()
    _check_device(device)
    _check_dtype(dtype)
    cuda = torch.device(device).type == "cuda"
    model = model or ("llama-dense" if cuda else "tiny-dense")
    validate_model(model)
    return device, cuda, model


def read_lengths_file(path: str) -> list[int]:
    """Prompt lengths from a text file: integers separated by whitespace or commas (``#`` starts a comment).

    Example::

        read_lengths_file("lengths.txt")   # "128\\n512, 2048  # long ones\\n" -> [128, 512, 2048]
    """
    try:
        text = open(path).read()
    except OSError as e:
        raise ValueError(f"--lengths-file {path!r}: {e.strerror}") from None
    tokens = [t for line in text.splitlines() for t in line.split("#", 1)[0].replace(",", " ").split()]
    if not tokens:
        raise ValueError(f"--lengths-file {path!r} holds no lengths")
    return parse_int_list(",".join(tokens), "lengths-file")
