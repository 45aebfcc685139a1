"""What the microbenchmarks of :mod:`bcg.bench.machine` time, and how: their sizes, the two timers, and the probes.

Most probes are tiny in-place adds on a one-element tensor (a few MiB for the medium kernel), so the kernels
themselves cost next to nothing and what is timed is the path around them: eagerly, inside a captured graph, inside a
breakable graph with a break between adds, inside a torch.compile piece. :func:`mixed_chain` runs different kernels
in turn as a layer runs them (a GEMM, an add, a norm, SiLU-and-multiply): a graph of a model starts each kernel after
a different one, which one add repeated does not show; :func:`fused_chain` is the same with bcg's own Triton kernels
between the GEMMs, as the fused kernels setting runs a layer. :func:`segment_starts` times, with the device the slower
clock, what a segment launched after an island's eager kernel costs the device beyond its kernels. The sizes below
are part of the key of the costs kept on disk (:mod:`bcg.bench.machine_cache`): changing one measures again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from bcg.bench.timing import sync

__all__ = ["CHAIN_SHAPE", "MEDIUM_ELEMENTS", "N_BREAKS", "N_CHAIN", "N_GRAPHS", "N_KERNELS", "N_MEDIUM", "REPS",
           "SLEEP_CYCLES", "adds", "breakable", "capture", "capture_calls", "fused_chain", "graph_memory", "host_us",
           "mixed_chain", "piece", "profiled_spans", "segment_starts", "wall_us"]

N_KERNELS = 1000  # kernels of the long graph and of the eager launch loop
N_BREAKS = 16
N_MEDIUM = 200  # kernels of the medium graph
MEDIUM_ELEMENTS = {"cuda": 2**20, "cpu": 2**10}  # a 4 MiB add on a GPU (the CPU's: small, to stay quick)
N_GRAPHS = 64  # one-kernel graphs of the per-graph memory benchmark
N_CHAIN = 20  # calls of the mixed chain in its graph and in its profile
# (tokens, hidden width, intermediate width) of the mixed chain: a small model's layer at a short prompt on a GPU
CHAIN_SHAPE = {"cuda": (64, 1024, 2816), "cpu": (8, 64, 176)}
REPS = 15
# The long kernel of each segment of the segment-start probe: about 25 µs on a 2 GHz GPU, so the device, not the host
# launching the segments, sets the pace of the replay.
SLEEP_CYCLES = 50_000


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
    x = torch.zeros(elements, device="cpu" if emulated else "cuda")
    return capture_calls(lambda: x.add_(1.0), n, emulated, stream)


def capture_calls(fn: Callable[[], Any], n: int, emulated: bool, stream: Any) -> Any:
    """A plain graph of ``n`` calls of ``fn`` (an emulated graph on a CPU)."""
    from bcg.runtime.backends.capture import capturing, new_graph

    graph = new_graph(emulated)
    with capturing(graph, None, stream):
        for _ in range(n):
            fn()
    return graph


def _chain_inputs(device: torch.device, shape: tuple[int, int, int] | None
                  ) -> tuple[tuple[int, int, int], torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Both chains' shape (default the device's :data:`CHAIN_SHAPE`), dtype (bf16 on a GPU, float32 on a CPU) and
    seeded inputs: the activation, the square weight and the gate/up activation, scaled by their last dimension."""
    tokens, width, inner = shape or CHAIN_SHAPE[device.type]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    x, w, gate_up = (torch.randn(*s, device=device, generator=g).mul_(s[-1] ** -0.5).to(dtype)
                     for s in ((tokens, width), (width, width), (tokens, 2 * inner)))
    return (tokens, width, inner), dtype, (x, w, gate_up)


def mixed_chain(device: torch.device, shape: tuple[int, int, int] | None = None) -> Callable[[], None]:
    """Different kernels in turn, as a layer runs them at a short prompt: a GEMM, a residual add, an RMSNorm in torch
    ops, SiLU-and-multiply, of ``shape`` (tokens, width, intermediate width; default the device's
    :data:`CHAIN_SHAPE`); each call writes only buffers made here (capturable as it is).

    Example::

        chain = mixed_chain(torch.device("cuda"))
        chain()          # about ten kernels (bf16 on a GPU, float32 on a CPU)
    """
    (tokens, width, inner), dtype, (x, w, gate_up) = _chain_inputs(device, shape)
    h, r, sq, normed = (torch.empty(tokens, width, device=device, dtype=dtype) for _ in range(4))
    var = torch.empty(tokens, 1, device=device, dtype=torch.float32)
    act = torch.empty(tokens, inner, device=device, dtype=dtype)

    def chain() -> None:
        torch.mm(x, w, out=h)
        torch.add(h, x, out=r)
        torch.pow(r, 2, out=sq)
        torch.mean(sq.float(), dim=-1, keepdim=True, out=var)
        torch.mul(r, torch.rsqrt(var + 1e-6).to(dtype), out=normed)
        torch.mul(torch.nn.functional.silu(gate_up[:, :inner]), gate_up[:, inner:], out=act)

    return chain


def fused_chain(device: torch.device, shape: tuple[int, int, int] | None = None) -> tuple[Callable[[], None], int]:
    """:func:`mixed_chain` with bcg's fused kernels: a GEMM, the residual add + RMSNorm in one Triton kernel,
    SiLU-and-multiply in another (:mod:`bcg.ops.kernels`), of the same ``shape``; returns the chain and its Triton
    kernels per call (0 where the kernels run their plain-torch reference: on a CPU, or without Triton).

    Example::

        chain, triton = fused_chain(torch.device("cuda"))
        chain()          # three kernels, two of them Triton's
    """
    from bcg.ops import kernels

    (tokens, width, inner), dtype, (x, w, gate_up) = _chain_inputs(device, shape)
    h, residual = torch.empty_like(x), x.clone()
    weight = torch.ones(width, device=device, dtype=dtype)
    act = torch.empty(tokens, inner, device=device, dtype=dtype)

    def chain() -> None:
        torch.mm(x, w, out=h)
        kernels.fused_add_rms_norm(h, residual, weight, 1e-6)  # residual += h, h = its norm: h grows no further
        kernels.silu_and_mul(gate_up, out=act)

    return chain, 2 if kernels.fused_available(device) else 0


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


def segment_starts(emulated: bool, stream: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two replays of the same kernels, to time: a breakable graph of :data:`N_BREAKS` + 1 segments (a long kernel,
    then an add) with an island launching one add between each two, and one plain graph of the same kernels without
    the breaks. The long kernels keep the device the slower clock in both, so their difference per break is what the
    device spends starting a segment after eager work, beyond the kernels themselves.

    Example::

        broken, whole = segment_starts(False, torch.cuda.Stream())
        (wall_us(broken, dev) - wall_us(whole, dev)) / N_BREAKS      # device µs a segment start costs
    """
    import bcg

    x = torch.zeros(1, device="cpu" if emulated else "cuda")

    @bcg.eager_on_graph
    def island(t: torch.Tensor) -> None:
        t.add_(1.0)

    def step(breaks: bool) -> None:
        for i in range(N_BREAKS + 1):
            if emulated:
                x.mul_(1.0)  # the emulation has no sleep kernel; its numbers mean nothing for a GPU anyway
            else:
                torch.cuda._sleep(SLEEP_CYCLES)
            x.add_(1.0)
            if i < N_BREAKS:
                island(x) if breaks else x.add_(1.0)

    broken = bcg.BreakableCUDAGraph(emulate=emulated)
    with bcg.breakable_graph(broken, stream=stream):
        step(True)
    whole = capture_calls(lambda: step(False), 1, emulated, stream)
    return broken.replay, whole.replay


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


def graph_memory(emulated: bool, stream: Any, device: torch.device) -> tuple[float, float]:
    """(bytes per kernel node, bytes per graph executable) from the device's free memory around captures of
    :data:`N_KERNELS` x 4 tiny kernels and of :data:`N_GRAPHS` one-kernel graphs (0, 0 under the emulation)."""
    if emulated:
        return 0.0, 0.0
    from bcg.bench.engines import release_memory

    release_memory()
    free0 = torch.cuda.mem_get_info(device)[0]
    big = capture(4 * N_KERNELS, emulated, stream)
    free1 = torch.cuda.mem_get_info(device)[0]
    small = [capture(1, emulated, stream) for _ in range(N_GRAPHS)]
    free2 = torch.cuda.mem_get_info(device)[0]
    del big, small
    release_memory()
    return max(free0 - free1, 0) / (4 * N_KERNELS), max(free1 - free2, 0) / N_GRAPHS


def profiled_spans(fn: Any, calls: int, device: torch.device) -> list[float]:
    """The device time of every kernel of ``calls`` calls of ``fn``, run eagerly in one profile after two untimed
    calls (on a CPU, each computing op's time: the emulation's kernels)."""
    from torch.profiler import ProfilerActivity

    from bcg.bench.quiet_profiler import quiet_profile

    fn()
    fn()
    sync(device)
    cuda = device.type == "cuda"
    with quiet_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    if cuda:
        return [e.time_range.end - e.time_range.start for e in prof.events()
                if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start]
    from bcg.bench.trace import kernels_from_events

    return [k.device_us for k in kernels_from_events(prof.events(), cuda=False).kernels]
