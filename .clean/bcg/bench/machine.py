"""What launching costs on this machine: the microbenchmarks behind every prediction of ``bcg analyze``.

Each number times the path around kernels that cost next to nothing (:mod:`bcg.bench.machine_probes` has the probes,
sizes and timers): an eager launch, a kernel inside a replayed graph, a graph launch, a break, a segment's start on the
device, a piece of torch.compile piecewise, a capture; the graph memory each node and each graph executable holds;
dynamo's guards per call and a compile per layer-like block (:mod:`bcg.bench.machine_compile`). A process measures
them once and :mod:`bcg.bench.machine_cache` keeps them on disk. Under the CPU emulation they run the same code
(emulated graphs) and mean nothing for a GPU. The host-side benchmarks (:func:`measure`) run before anything is
profiled; :func:`measure_device` reads the numbers that need the profiler (the eager device time of a tiny kernel, a
medium one and the two chains) last, because the profiler, once loaded, slows later host work.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bcg.bench.machine_compile import COMPILE_BLOCK_KERNELS, compile_block, compile_costs, guard_costs
from bcg.bench.machine_probes import (
    MEDIUM_ELEMENTS,
    N_BREAKS,
    N_CHAIN,
    N_KERNELS,
    N_MEDIUM,
    adds,
    breakable,
    capture,
    capture_calls,
    fused_chain,
    graph_memory,
    host_us,
    mixed_chain,
    piece,
    profiled_spans,
    segment_starts,
    wall_us,
)

__all__ = ["COMPILE_BLOCK_KERNELS", "DEVICE_FIELDS", "MachineCosts", "compile_block", "measure", "measure_device",
           "replace_device"]

# What measure_device fills in: device times, the same whatever the host's cores.
DEVICE_FIELDS = ("tiny_kernel_us", "medium_kernel_us", "chain_kernel_us", "chain_kernels", "fused_chain_kernel_us",
                 "fused_chain_kernels")


@dataclass
class MachineCosts:
    """This machine's launch, replay, capture and compile costs (µs unless named otherwise).

    Attributes:
        eager_launch_us: host time of one eager kernel launch (not waiting for the device).
        eager_kernel_us: wall time per kernel of back-to-back eager launches (host and device together).
        tiny_kernel_us: device time of the tiny kernel run eagerly (the profiler's; on a CPU its op time).
        graph_kernel_us: device time per kernel of a replayed graph of tiny kernels.
        medium_kernel_us / graph_medium_kernel_us: the same two for a kernel that moves a few MiB (None: not
            measured): between the two sizes a graph's per-kernel gap is interpolated.
        graph_chain_us / chain_kernel_us / chain_kernels: one call of the mixed chain (different kernels in turn,
            :func:`~bcg.bench.machine_probes.mixed_chain`): its device time in a replayed graph, its kernels' summed
            eager device time (the profiler's), and its kernels (None: not measured). Where measured, their
            difference per kernel is a graph's per-kernel gap, for kernels of every size.
        graph_fused_chain_us / fused_chain_kernel_us / fused_chain_kernels / fused_chain_triton: the same for the
            fused chain (:func:`~bcg.bench.machine_probes.fused_chain`), with its Triton kernels per call (0: the
            chain ran the plain-torch reference, and a Triton kernel's gap is the others').
        graph_launch_us: host time to launch (replay) a one-kernel graph; graph_launch_per_node_us: host time each
            further kernel node adds to a launch.
        break_us: host time a break adds at replay besides the segment launches and the island's own work.
        segment_start_us: device time a graph launched after eager work (a segment after an island, a piece) takes
            beyond its kernels (:func:`~bcg.bench.machine_probes.segment_starts`; 0: not measured).
        piece_us: host time of one torch.compile piece called in a piecewise graph, its graph's replay included.
        capture_per_node_us / capture_per_graph_us: capture and instantiation time per kernel and per graph.
        graph_node_bytes / graph_bytes: device memory per kernel node and per graph executable (0 on a CPU).
        guard_us / guard_per_param_us: host time dynamo adds to a compiled call, and per parameter tensor.
        compile_ms: per compiler ("inductor", "traced"), (fixed ms of a compile, ms per kernel compiled).
        seconds: how long the benchmarks took; cached: True when they were this process's earlier measurement.
        path_layer_us / path_fixed_us: per backend, the real replay path's host µs per layer beyond the island's
            own, and per forward beyond its layers and its batch's load (:mod:`bcg.bench.paths`; empty: not
            measured, the primitives above stand in); path_params_per_layer / path_params_fixed: the parameter
            tensors of one layer of that toy, and outside its layers.
    """

    device: str
    emulated: bool
    eager_launch_us: float
    eager_kernel_us: float
    graph_kernel_us: float
    graph_launch_us: float
    graph_launch_per_node_us: float
    break_us: float
    piece_us: float
    capture_per_node_us: float
    capture_per_graph_us: float
    graph_node_bytes: float = 0.0
    graph_bytes: float = 0.0
    segment_start_us: float = 0.0
    tiny_kernel_us: float | None = None
    medium_kernel_us: float | None = None
    graph_medium_kernel_us: float | None = None
    graph_chain_us: float | None = None
    chain_kernel_us: float | None = None
    chain_kernels: float | None = None
    graph_fused_chain_us: float | None = None
    fused_chain_kernel_us: float | None = None
    fused_chain_kernels: float | None = None
    fused_chain_triton: float = 0.0
    guard_us: float = 0.0
    guard_per_param_us: float = 0.0
    compile_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False
    path_layer_us: dict[str, float] = field(default_factory=dict)
    path_fixed_us: dict[str, float] = field(default_factory=dict)
    path_params_per_layer: float = 0.0
    path_params_fixed: float = 0.0

    @property
    def graph_gap_us(self) -> float:
        """What a kernel's device time changes by inside a graph: the per-kernel replay cost minus the tiny kernel's
        own device time (0 until :func:`measure_device` ran)."""
        return 0.0 if self.tiny_kernel_us is None else self.graph_kernel_us - self.tiny_kernel_us

    @property
    def chain_gap_us(self) -> float | None:
        """What each kernel of a graph of different kernels takes beyond its eager device time (the mixed chain's
        replay less its kernels' profiled times, per kernel); None until measured."""
        if self.graph_chain_us is None or self.chain_kernel_us is None or not self.chain_kernels:
            return None
        return (self.graph_chain_us - self.chain_kernel_us) / self.chain_kernels

    def graph_gap(self, device_us: float) -> float:
        """What a kernel of ``device_us`` changes by inside a graph of a model: the mixed chain's gap where measured
        (a model's graph starts each kernel after a different one); else the tiny kernel's gap, the medium kernel's
        at its size, linear between and flat beyond (back-to-back kernels hide part of their start; long ones
        little)."""
        chain = self.chain_gap_us
        if chain is not None:
            return chain
        tiny = self.graph_gap_us
        if self.tiny_kernel_us is None or self.medium_kernel_us is None or self.graph_medium_kernel_us is None:
            return tiny
        medium = self.graph_medium_kernel_us - self.medium_kernel_us
        low, high = self.tiny_kernel_us, self.medium_kernel_us
        if device_us <= low or high <= low:
            return tiny
        if device_us >= high:
            return medium
        return tiny + (medium - tiny) * (device_us - low) / (high - low)

    def triton_gap(self, device_us: float) -> float:
        """What one of bcg's Triton kernels of ``device_us`` changes by inside a graph: the fused chain's time in a
        graph beyond its kernels' eager times and its other kernels' gap (:meth:`graph_gap`), per Triton kernel;
        :meth:`graph_gap` itself where the fused chain ran no Triton kernel."""
        other = self.graph_gap(device_us)
        graph, alone, n = self.graph_fused_chain_us, self.fused_chain_kernel_us, self.fused_chain_kernels
        if graph is None or alone is None or not n or not self.fused_chain_triton:
            return other
        return (graph - alone - other * (n - self.fused_chain_triton)) / self.fused_chain_triton

    def tc_call_us(self, num_params: int) -> float:
        """Host time dynamo adds to one call of a compiled function reading ``num_params`` parameter tensors."""
        return self.guard_us + self.guard_per_param_us * num_params


# Earlier measurements of this process, by what they depend on (none of it is the model's): see measure().
_CACHE: dict[tuple, MachineCosts] = {}
_DEVICE_CACHE: dict[str, dict[str, Any]] = {}  # device -> its DEVICE_FIELDS


def _cache_key(device: torch.device, compilers: tuple[str, ...], guards: bool) -> tuple:
    cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return str(device), tuple(sorted(compilers)), guards, cores, torch.get_num_threads()


def measure(device: torch.device | str, compilers: tuple[str, ...] = (), guards: bool = False,
            cache: bool = True) -> MachineCosts:
    """Runs the host-side microbenchmarks on ``device`` (the CPU emulation on a CPU); ``compilers`` also times a
    compile with each, ``guards`` dynamo's call overhead. Nothing here depends on the model, so with ``cache`` a
    process measures each (device, compilers, guards, cores, threads) once and later calls get a copy of it
    (``cached`` True, ``seconds`` 0). Example::

        costs = measure("cuda", compilers=("inductor",), guards=True)
        costs.eager_launch_us, costs.graph_kernel_us      # e.g. 9.6 and 1.0 on an H200
    """
    device = torch.device(device)
    key = _cache_key(device, compilers, guards)
    if cache and key in _CACHE:
        return replace(_CACHE[key], compile_ms=dict(_CACHE[key].compile_ms), seconds=0.0, cached=True)
    costs = _measure(device, compilers, guards)
    _CACHE[key] = replace(costs, compile_ms=dict(costs.compile_ms))
    return costs


def _measure(device: torch.device, compilers: tuple[str, ...], guards: bool) -> MachineCosts:
    emulated = device.type != "cuda"
    stream = None if emulated else torch.cuda.Stream(device)
    t_start = time.perf_counter()
    x = torch.zeros(1, device=device)
    with torch.inference_mode():
        adds(x, 50)
        launch = host_us(lambda: adds(x, N_KERNELS), device, reps=5) / N_KERNELS
        eager_wall = wall_us(lambda: adds(x, N_KERNELS), device, reps=5) / N_KERNELS
        one, many = capture(1, emulated, stream), capture(N_KERNELS, emulated, stream)
        graph_kernel = wall_us(many.replay, device) / N_KERNELS
        medium = capture(N_MEDIUM, emulated, stream, MEDIUM_ELEMENTS[device.type])
        graph_medium = wall_us(medium.replay, device) / N_MEDIUM
        chain = mixed_chain(device)
        _warm(chain, stream)
        graph_chain = wall_us(capture_calls(chain, N_CHAIN, emulated, stream).replay, device) / N_CHAIN
        fused, triton = fused_chain(device)
        _warm(fused, stream)  # Triton compiles each kernel at its first call
        graph_fused = wall_us(capture_calls(fused, N_CHAIN, emulated, stream).replay, device) / N_CHAIN
        launch_one = host_us(one.replay, device)
        per_node = max((host_us(many.replay, device) - launch_one) / (N_KERNELS - 1), 0.0)
        broken = breakable(emulated, stream)
        breaks = max((host_us(broken.replay, device) - (N_BREAKS + 1) * launch_one) / N_BREAKS, 0.0)
        piece_host = host_us(piece(emulated, stream), device)
        broken_replay, whole_replay = segment_starts(emulated, stream)
        segment_start = (wall_us(broken_replay, device) - wall_us(whole_replay, device)) / N_BREAKS
        t0 = time.perf_counter()
        capture(1, emulated, stream)
        cap_one = (time.perf_counter() - t0) * 1e6
        t0 = time.perf_counter()
        capture(N_KERNELS, emulated, stream)
        cap_many = (time.perf_counter() - t0) * 1e6
    node_bytes, graph_bytes = graph_memory(emulated, stream, device)
    costs = MachineCosts(
        device=str(device), emulated=emulated, eager_launch_us=launch, eager_kernel_us=eager_wall,
        graph_kernel_us=graph_kernel, graph_launch_us=launch_one, graph_launch_per_node_us=per_node, break_us=breaks,
        piece_us=piece_host, capture_per_node_us=max((cap_many - cap_one) / (N_KERNELS - 1), 0.0),
        capture_per_graph_us=cap_one, graph_node_bytes=node_bytes, graph_bytes=graph_bytes,
        graph_medium_kernel_us=graph_medium, graph_chain_us=graph_chain, graph_fused_chain_us=graph_fused,
        fused_chain_triton=float(triton), segment_start_us=max(segment_start, 0.0))
    if guards:
        costs.guard_us, costs.guard_per_param_us = guard_costs(device)
    for compiler in compilers:
        costs.compile_ms[compiler] = compile_costs(compiler, device)
    costs.seconds = time.perf_counter() - t_start
    return costs


def _warm(fn: Any, stream: Any) -> None:
    """Two calls of ``fn`` on the capture stream before its capture (cuBLAS sets up its handle for a stream on its
    first GEMM there)."""
    with torch.inference_mode(), nullcontext() if stream is None else torch.cuda.stream(stream):
        fn()
        fn()
    if stream is not None:
        stream.synchronize()


def measure_device(costs: MachineCosts, cache: bool = True) -> MachineCosts:
    """Fills in :data:`DEVICE_FIELDS`: the profiler's device time of a tiny and of a medium kernel run eagerly, and
    of the mixed chain's kernels with their count (on a CPU the host time of each add and of the chain, as the
    emulation's kernels are its ops). Run it after every host timing of the process. With ``cache`` a process
    measures each device once (:data:`_DEVICE_CACHE`)."""
    device = torch.device(costs.device)
    if cache and str(device) in _DEVICE_CACHE:
        return replace_device(costs, _DEVICE_CACHE[str(device)])
    x = torch.zeros(1, device=device)
    y = torch.zeros(MEDIUM_ELEMENTS[device.type], device=device)
    chain, fused = mixed_chain(device), fused_chain(device)[0]
    t0 = time.perf_counter()
    with torch.inference_mode():
        if costs.emulated:
            costs.tiny_kernel_us = host_us(lambda: adds(x, N_KERNELS), device, reps=5) / N_KERNELS
            costs.medium_kernel_us = host_us(lambda: adds(y, N_MEDIUM), device, reps=5) / N_MEDIUM
            costs.chain_kernel_us = host_us(chain, device, reps=5)
            costs.chain_kernels = float(len(profiled_spans(chain, 1, device)))
            costs.fused_chain_kernel_us = host_us(fused, device, reps=5)
            costs.fused_chain_kernels = float(len(profiled_spans(fused, 1, device)))
        else:
            costs.tiny_kernel_us = _median(profiled_spans(lambda: adds(x, 200), 1, device))
            costs.medium_kernel_us = _median(profiled_spans(lambda: adds(y, 50), 1, device))
            spans = profiled_spans(chain, N_CHAIN, device)
            costs.chain_kernel_us, costs.chain_kernels = sum(spans) / N_CHAIN, len(spans) / N_CHAIN
            spans = profiled_spans(fused, N_CHAIN, device)
            costs.fused_chain_kernel_us, costs.fused_chain_kernels = sum(spans) / N_CHAIN, len(spans) / N_CHAIN
    costs.seconds += time.perf_counter() - t0
    _DEVICE_CACHE[str(device)] = {f: getattr(costs, f) for f in DEVICE_FIELDS}
    return costs


def replace_device(costs: MachineCosts, fields: dict[str, Any]) -> MachineCosts:
    """``costs`` with the :data:`DEVICE_FIELDS` ``fields`` holds set (in place; a missing one stays unmeasured)."""
    for f in DEVICE_FIELDS:
        v = fields.get(f)
        setattr(costs, f, None if v is None else float(v))
    return costs


def _median(spans: list[float]) -> float | None:
    return statistics.median(spans) if spans else None
