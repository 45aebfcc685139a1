"""The open-loop workload of ``bcg load``: when requests arrive and how long they are.

Arrivals are a Poisson process at the offered rate (exponential gaps), or the times of a trace file. Prompt lengths
come from ``--lengths``: ``fixed:N``; ``lognormal:MEDIAN`` (sigma 1, clipped to ``[min(16, MEDIAN), max(4000,
MEDIAN)]``) or ``lognormal:MEDIAN:MIN:MAX``; or a file of lengths, sampled uniformly. Every prompt opens with the
same ``--shared-prefix`` tokens (a system prompt) followed by its own random tokens of the drawn length. Everything
is seeded: the same flags give every backend the same requests at the same times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bcg.bench.checks import MAX_LENGTH, parse_int_list, read_lengths_file

__all__ = ["LengthSpec", "Workload", "make_workload", "parse_lengths", "read_trace"]

LOGNORMAL_SIGMA = 1.0


@dataclass(frozen=True)
class LengthSpec:
    """A prompt-length distribution: ``kind`` "fixed", "lognormal" or "file" (``values``: the file's lengths)."""

    kind: str
    median: int = 0
    low: int = 1
    high: int = 1
    values: tuple[int, ...] = ()

    @property
    def longest(self) -> int:
        return max(self.values) if self.kind == "file" else self.high

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths (int64)."""
        if self.kind == "fixed":
            return np.full(n, self.median, dtype=np.int64)
        if self.kind == "file":
            return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), n)]
        draws = np.exp(rng.normal(np.log(self.median), LOGNORMAL_SIGMA, n))
        return np.clip(np.rint(draws), self.low, self.high).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.median} tokens each"
        if self.kind == "file":
            return f"{len(self.values)} lengths from a file ({min(self.values)}-{max(self.values)} tokens)"
        return f"lognormal, median {self.median}, sigma {LOGNORMAL_SIGMA:g}, {self.low}-{self.high} tokens"


def parse_lengths(text: str) -> LengthSpec:
    """Parses ``--lengths``; raises ValueError naming the problem.

    Example::

        >>> parse_lengths("lognormal:180")
        LengthSpec(kind='lognormal', median=180, low=16, high=4000, values=())
        >>> parse_lengths("fixed:64").median
        64
    """
    kind, _, rest = text.partition(":")
    if kind == "fixed" and rest:
        (n,) = _ints(text, rest, 1)
        return LengthSpec("fixed", n, n, n)
    if kind == "lognormal" and rest:
        parts = rest.split(":")
        if len(parts) not in (1, 3):
            raise ValueError(f"--lengths {text!r}: give lognormal:MEDIAN or lognormal:MEDIAN:MIN:MAX")
        median, *bounds = _ints(text, rest.replace(":", ","), len(parts))
        low, high = bounds if bounds else (min(16, median), max(4000, median))
        if not low <= median <= high:
            raise ValueError(f"--lengths {text!r}: need MIN <= MEDIAN <= MAX")
        return LengthSpec("lognormal", median, low, high)
    if Path(text).is_file():
        values = read_lengths_file(text, "--lengths")
        return LengthSpec("file", values=tuple(values), low=min(values), high=max(values))
    raise ValueError(f"--lengths {text!r} is neither fixed:N, lognormal:MEDIAN[:MIN:MAX] nor a file of lengths")


def _ints(text: str, items: str, count: int) -> list[int]:
    try:
        values = parse_int_list(items)
    except ValueError as e:
        raise ValueError(f"--lengths {text!r}: {e}") from None
    if len(values) != count or any(v > MAX_LENGTH for v in values):
        raise ValueError(f"--lengths {text!r}: expected {count} length(s) in [1, {MAX_LENGTH}]")
    return values


def read_trace(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (seconds from the start, ascending) and prompt lengths from a trace file: one request per line,
    ``ARRIVAL_S LENGTH`` separated by whitespace or a comma (``#`` starts a comment)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--trace {path!r} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    times, lengths = [], []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if not fields:
            continue
        try:
            t, n = float(fields[0]), int(fields[1])
            if len(fields) != 2:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"--trace {path!r} line {number}: expected 'ARRIVAL_S LENGTH', got {line.strip()!r}"
                             ) from None
        if not (np.isfinite(t) and t >= 0 and 1 <= n <= MAX_LENGTH):
            raise ValueError(f"--trace {path!r} line {number}: need a time >= 0 and a length in [1, {MAX_LENGTH}]")
        times.append(t)
        lengths.append(n)
    if not times:
        raise ValueError(f"--trace {path!r} holds no requests")
    order = np.argsort(times, kind="stable")
    return np.asarray(times)[order], np.asarray(lengths, dtype=np.int64)[order]


@dataclass
class Workload:
    """One rate's requests: arrival times (seconds from the start) and prompts (CPU int64 tensors)."""

    rate: float  # offered requests per second
    arrivals: np.ndarray
    prompts: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(p.numel() for p in self.prompts)


def make_workload(rate: float, duration: float, lengths: LengthSpec | None, shared_prefix: int, vocab_size: int,
                  seed: int, trace: tuple[np.ndarray, np.ndarray] | None = None) -> Workload:
    """The requests of one rate over ``duration`` seconds (a trace: its own times and lengths, cut at ``duration``).

    Example::

        >>> w = make_workload(50.0, 2.0, parse_lengths("fixed:8"), 4, 256, seed=0)
        >>> 60 < len(w.prompts) < 140, w.prompts[0].numel(), bool((w.prompts[0][:4] == w.prompts[1][:4]).all())
        (True, 12, True)
    """
    rng = np.random.default_rng([seed, int(rate * 1000)])
    if trace is not None:
        times, sizes = trace
        keep = times <= duration
        times, sizes = times[keep], sizes[keep]
    else:
        gaps = rng.exponential(1.0 / rate, int(rate * duration * 1.5) + 16)
        times = np.cumsum(gaps)
        times = times[times <= duration]
        sizes = lengths.sample(rng, len(times))
    prefix = rng.integers(0, vocab_size, shared_prefix)
    tails = rng.integers(0, vocab_size, int(sizes.sum()))
    parts = np.split(tails, np.cumsum(sizes)[:-1]) if len(sizes) else []
    prompts = [torch.from_numpy(np.concatenate([prefix, t])) for t in parts]
    return Workload(rate, times, prompts)
