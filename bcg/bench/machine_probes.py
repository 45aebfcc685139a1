"""What the microbenchmarks of :mod:`bcg.bench.machine` time, and how: their sizes, the two timers, and the probes.

Every probe is tiny in-place adds on a one-element tensor (a few MiB for the medium kernel), so the kernels
themselves cost next to nothing and what is timed is the path around them: eagerly, inside a captured graph, inside a
breakable graph with a break between adds, inside a torch.compile piece. The sizes below are part of the key of the
costs kept on disk (:mod:`bcg.bench.machine_cache`): changing one measures again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from bcg.bench.timing import sync

__all__ = ["MEDIUM_ELEMENTS", "N_BREAKS", "N_GRAPHS", "N_KERNELS", "N_MEDIUM", "REPS", "adds", "breakable",
           "capture", "host_us", "piece", "wall_us"]

N_KERNELS = 1000  # kernels of the long graph and of the eager launch loop
N_BREAKS = 16
N_MEDIUM = 200  # kernels of the medium graph
MEDIUM_ELEMENTS = {"cuda": 2**20, "cpu": 2**10}  # a 4 MiB add on a GPU (the CPU's: small, to stay quick)
N_GRAPHS = 64  # one-kernel graphs of the per-graph memory benchmark
REPS = 15


def host_us(fn: Callable[[], Any], device: torch.device, reps: int = REPS) -> float:
    """Median host time of ``fn`` from an idle device, not waiting for what it enqueues."""
    samples = []
    for i in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= 2:
            samples.append((t1 - t0) * 1e6)
    sync(device)
    return statistics.median(samples)


def wall_us(fn: Callable[[], Any], device: torch.device, reps: int = REPS) -> float:
    """Median wall time of ``fn`` until the device is done (CUDA events on a GPU)."""
    from bcg.bench.timing import time_fn

    return time_fn(fn, device, runs=reps, warmup=2).median_ms * 1e3


def adds(x: torch.Tensor, n: int) -> None:
    """``n`` in-place adds on ``x``: ``n`` kernels (on a CPU, ``n`` ops)."""
    for _ in range(n):
        x.add_(1.0)


def capture(n: int, emulated: bool, stream: Any, elements: int = 1) -> Any:
    """A plain graph of ``n`` adds on a tensor of ``elements`` (an emulated graph on a CPU)."""
    from bcg.runtime.backends.capture import capturing, new_graph

    x = torch.zeros(elements, device="cpu" if emulated else "cuda")
    graph = new_graph(emulated)
    with capturing(graph, None, stream):
        adds(x, n)
    return graph


def _break_step(x: torch.Tensor) -> None:
    from bcg.islands import break_graph

    for i in range(N_BREAKS + 1):
        x.add_(1.0)
        if i < N_BREAKS:
            break_graph()


def breakable(emulated: bool, stream: Any) -> Any:
    """A breakable graph of :data:`N_BREAKS` + 1 adds with a break between each two."""
    import bcg

    x = torch.zeros(1, device="cpu" if emulated else "cuda")
    graph = bcg.BreakableCUDAGraph(emulate=emulated)
    with bcg.breakable_graph(graph, stream=stream):
        _break_step(x)
    return graph


def piece(emulated: bool, stream: Any) -> Callable[[], Any]:
    """One torch.compile piece (bcg's own piece class) captured for one bucket, called as a piecewise replay calls
    it."""
    from bcg.runtime.backends.capture import GraphPool
    from bcg.runtime.backends.piecewise import GraphedPiece, PieceRuntime

    x = torch.zeros(1, device="cpu" if emulated else "cuda")
    runtime = PieceRuntime(pool=GraphPool(stream), is_emulated=emulated)
    graphed = GraphedPiece("probe", lambda t: t.add_(1.0), runtime)
    runtime.mode, runtime.bucket = "capture", 1
    with nullcontext() if stream is None else torch.cuda.stream(stream):
        graphed(x)
    runtime.mode = "replay"
    return lambda: graphed(x)
