"""The prediction model: every backend's prefill as a program of host work and device work, played on one host and
one device, from one profiled eager forward and this machine's launch costs.

A program is a list of :class:`Launch` steps. Each takes host time; a step that enqueues device work (a kernel, a
graph launch) starts it when both the host has issued it and the device has finished what came before, so
:func:`simulate` is the two-clock pipeline a CUDA stream is: the wall time is whichever clock finishes last. A
host-bound forward ends on the host clock (eager: every kernel costs a launch), a device-bound one on the device
clock (a replay: kernels back to back, about :attr:`~bcg.bench.machine.MachineCosts.graph_kernel_us` apart).

Each backend's program, built from the eager trace (:mod:`bcg.bench.trace`) and the host times of the same forward
(:class:`HostTimes`):

* every backend: the engine's host work before the forward and loading the batch, then graphs and islands, then the
  engine's host work after the forward (which a device still busy with the forward hides);
* ``breakable``: one graph launch per segment, the break's own overhead, and each island's measured host time
  spreading its kernels' launches;
* ``full``: one graph launch for the whole step, whose kernels are those of the step run eagerly under the static
  attention (the full trace);
* ``tc_piecewise``: pieces like breakable's segments, but each piece and each island costs a Python call into the
  split graph, every forward pays dynamo's guards once, and the K/V write of each attention layer runs eagerly in
  the island (its split point is the whole ``bcg::attention`` op);
* compiled variants (``+inductor``, and ``tc_piecewise`` with Inductor): :func:`fuse` merges each run of fusible
  kernels between matmul-like ones into one kernel.

The programs' steps and how they are played are :mod:`bcg.bench.program`'s, the fusion rule
:mod:`bcg.bench.fusion_rule`'s (both re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bcg.bench.fusion_rule import FUSION_REST, fuse, is_fusible
from bcg.bench.program import Launch, Played, program_from_parts, simulate
from bcg.bench.trace import ForwardTrace, Kernel, Region, regions

__all__ = ["FUSION_REST", "HostTimes", "Launch", "Played", "breakable_program", "full_program", "fuse",
           "in_graph_us", "is_fusible", "islands_by_setting", "program_from_parts", "replay_islands", "simulate",
           "tc_piecewise_program"]

# The K/V write that precedes each attention island (two index_copy_), run eagerly in tc_piecewise's islands.
_KV_WRITE_OP = "aten::index_copy_"
ATTENTION_ISLAND = "attention_island"


@dataclass
class HostTimes:
    """Host-side times of one eager forward at ``num_tokens`` (unprofiled, :mod:`bcg.bench.profile`).

    Attributes:
        forward_ms: median wall time of ``runner.forward``; host_ms: the host time until it returned, from an idle
            device; prefill_ms: median wall time of ``Engine.prefill`` of the same prompt.
        load_us: host time to load the batch into its fields (the eager work before a replay); full_load_us: the
            same into the static attention's fields (``full``), None when not measured.
        island_us: host time per call of each island, by name; island_calls: calls per forward.
        island_bytes: bytes of tensor arguments per call of each island (what crosses a piece boundary).
        prefill_pre_us / prefill_post_us: the host time ``Engine.prefill`` spends before the forward starts and after it
            returns (None when not measured: the whole difference to the forward then comes first).
        low / high: these times at the lower and upper quartile of the runs (None when there is no spread).
    """

    num_tokens: int
    forward_ms: float
    host_ms: float
    prefill_ms: float
    load_us: float
    full_load_us: float | None = None
    island_us: dict[str, float] = field(default_factory=dict)
    island_calls: dict[str, int] = field(default_factory=dict)
    island_bytes: dict[str, float] = field(default_factory=dict)
    prefill_pre_us: float | None = None
    prefill_post_us: float | None = None
    runs: int = 0  # timed runs per series (fewer than asked once the spread settled: bcg.bench.profile.settled)
    warmups: int = 0  # untimed runs before them (fewer than asked once two agreed)
    # The same times at the lower and upper quartile of their runs (None: one run, no spread): the predictions'
    # intervals are these played through the same programs.
    low: HostTimes | None = field(default=None, repr=False, compare=False)
    high: HostTimes | None = field(default=None, repr=False, compare=False)

    @property
    def before_us(self) -> float:
        """The engine's host work before the forward (all of it when the split was not measured)."""
        return self.prefill_overhead_us if self.prefill_pre_us is None else self.prefill_pre_us

    @property
    def after_us(self) -> float:
        """The engine's host work after the forward returned: it overlaps a device still running the forward."""
        return 0.0 if self.prefill_pre_us is None else (self.prefill_post_us or 0.0)

    @property
    def prefill_overhead_us(self) -> float:
        """The engine's host work around one forward (prompt checks, scheduling, KV lease, sampling)."""
        return max(self.prefill_ms - self.forward_ms, 0.0) * 1e3

    @property
    def islands_us(self) -> float:
        """Host time of every island call of one forward."""
        return sum(self.island_us[n] * self.island_calls.get(n, 0) for n in self.island_us)



def replay_islands(hosts: dict[str, dict[int, HostTimes]], own: Collection[str] = ()
                   ) -> dict[str, dict[int, HostTimes]]:
    """``hosts`` (per kernels setting, per size) with each island's host µs per call as a replay would pay it: the
    least measured at that size or any longer one, over every setting (for the islands named in ``own``: over its
    own setting's sizes only).

    An island runs the same code whatever the kernels around it, and its host work does not shrink as the batch
    grows; what varies is the host's state around the call. In an eager forward whose other kernels are Triton
    launches the same island measured 80-100 µs on the H200 where the plain-torch forward measured 50-58 (and a
    stray run at one size 90), while a replay calls it between graph launches. An island whose own kernels differ
    between the settings (glm-dsa's ``select_topk``: torch's ops, or bcg's Triton top-k) runs other code in each, so
    it is in ``own`` (:func:`islands_by_setting`). The quartile bounds (``low``, ``high``) are settled the same way,
    each from its own series.

    Example::

        hosts = replay_islands(measurements.hosts[None])
        hosts["fused"][64].island_us["attention_island"]      # <= every size's and setting's from 64 up
    """
    def settle(pick: Callable[[HostTimes], HostTimes], setting: str) -> dict[str, dict[int, float]]:
        least: dict[str, dict[int, float]] = {}  # island -> size -> least over the settings
        for other, sizes in hosts.items():
            for n, h in sizes.items():
                for name, us in pick(h).island_us.items():
                    if other != setting and name in own:
                        continue
                    per = least.setdefault(name, {})
                    per[n] = min(per.get(n, us), us)
        return {name: {n: min(us for m, us in per.items() if m >= n) for n in per} for name, per in least.items()}

    def apply(h: HostTimes, table: dict[str, dict[int, float]], n: int) -> HostTimes:
        return replace(h, island_us={name: table[name][n] for name in h.island_us})

    out = {}
    for setting, sizes in hosts.items():
        mid, low, high = (settle(pick, setting) for pick in (lambda h: h, lambda h: h.low or h,
                                                              lambda h: h.high or h))
        out[setting] = {n: replace(apply(h, mid, n), low=apply(h.low, low, n) if h.low else None,
                                   high=apply(h.high, high, n) if h.high else None) for n, h in sizes.items()}
    return out


def islands_by_setting(traces: dict[str, ForwardTrace]) -> set[str]:
    """The islands whose calls launch other kernels under each kernels setting's trace of ``traces`` (the same size):
    other code, whose host cost is its own setting's (:func:`replay_islands`).

    Example::

        islands_by_setting({s: measurements.profiles[s][512].trace for s in measurements.profiles})  # {'select_topk'}
    """
    kernels: dict[str, set[tuple[str, ...]]] = {}
    for trace in traces.values():
        by_name: dict[str, tuple[str, ...]] = {}
        for r in regions(trace):
            if r.island is not None and r.island.name not in by_name:
                by_name[r.island.name] = tuple(k.name for k in r.kernels)
        for name, names in by_name.items():
            kernels.setdefault(name, set()).add(names)
    return {name for name, seen in kernels.items() if len(seen) > 1}


def in_graph_us(device_us: float, gap_us: float) -> float:
    """A kernel's device time inside a replayed graph: its eager device time plus the graph's per-kernel gap (which
    is negative where back-to-back kernels in a graph start sooner than a profiled eager kernel ran)."""
    return max(device_us + gap_us, 0.0)


def _graph(part: str, kernels: Sequence[Kernel], costs: Any, launch_us: float) -> Launch:
    # bcg's Triton kernels start later after a neighbour than torch's do (the fused chain measures their own gap);
    # every graph here is launched after eager work (the load, an island), which the device pays for at its start
    gap = [(costs.triton_gap if k.is_triton else costs.graph_gap)(k.device_us) for k in kernels]
    device = costs.segment_start_us + sum(in_graph_us(k.device_us, g) for k, g in zip(kernels, gap))
    return Launch(part, launch_us + costs.graph_launch_per_node_us * len(kernels), device, True, len(kernels))


def _outside(trace_regions: list[Region], host: HostTimes, load_us: float) -> list[Launch]:
    """The work before the first graph: the engine's steps and the batch's load, then the copies it enqueues (the
    leading copies of the first region, which leave it)."""
    program = [Launch("outside", host.before_us + load_us)]
    if trace_regions and trace_regions[0].island is None:
        ks = list(trace_regions[0].kernels)
        while ks and ks[0].is_copy:
            program.append(Launch("outside", 0.0, ks.pop(0).device_us, True))
        trace_regions[0] = Region(tuple(ks))
    return program


def _island(region: Region, host: HostTimes, overhead_us: float, extra: Sequence[Kernel] = (),
            launch_us: float = 0.0) -> list[Launch]:
    """One island call: its overhead, then its kernels' launches spread over its measured host time (``extra``:
    kernels that run eagerly with it, each at ``launch_us``)."""
    assert region.island is not None
    name = region.island.name
    part = f"island:{name}"
    steps = [Launch(part, overhead_us)]
    steps += [Launch(part, launch_us, k.device_us, True) for k in extra]
    ks = region.kernels
    h = host.island_us.get(name, 0.0)
    if not ks:
        return [*steps, Launch(part, h)]
    return steps + [Launch(part, h / len(ks), k.device_us, True) for k in ks]


def _path(costs: Any, backend: str) -> tuple[float | None, float]:
    """(host µs per layer of ``backend``'s real replay path beyond its island's own, None when not measured; host µs
    per forward beyond its layers and its load, the launch no layer owns included) from :mod:`bcg.bench.paths`."""
    layer = (getattr(costs, "path_layer_us", None) or {}).get(backend)
    return layer, (getattr(costs, "path_fixed_us", None) or {}).get(backend, 0.0)


def breakable_program(trace: ForwardTrace, host: HostTimes, costs: Any,
                      compiled: Callable[[Sequence[Kernel]], list[Kernel]] | None = None) -> list[Launch]:
    """The breakable replay of the step ``trace`` profiled: a graph launch per segment, each island eagerly; with
    ``compiled`` (e.g. :func:`fuse`) the segments run the compiled kernels."""
    rs = regions(trace)
    layer, fixed = _path(costs, "breakable")
    # The real path's cost of a break (the measured layer minus its segment's launch), else the primitive's.
    break_us = costs.break_us if layer is None else max(layer - costs.graph_launch_us, 0.0)
    # The path's per-forward cost less the segment no layer owns, whose launch is counted below.
    program = _outside(rs, host, host.load_us + max(fixed - costs.graph_launch_us, 0.0))
    for r in rs:
        if r.island is None:
            if r.kernels:
                program.append(_graph("segment", compiled(r.kernels) if compiled else r.kernels, costs,
                                      costs.graph_launch_us))
        else:
            program += _island(r, host, break_us)
    return [*program, Launch("after", host.after_us)]


def full_program(full_trace: ForwardTrace, host: HostTimes, costs: Any,
                 compiled: Callable[[Sequence[Kernel]], list[Kernel]] | None = None) -> list[Launch]:
    """The full backend's replay: one graph launch of every kernel of the step run under the static attention."""
    rs = regions(full_trace)
    load = host.full_load_us if host.full_load_us is not None else host.load_us
    _, fixed = _path(costs, "full")  # less the graph's launch, counted below
    program = _outside(rs, host, load + max(fixed - costs.graph_launch_us, 0.0))
    kernels = [k for r in rs for k in r.kernels]
    program.append(_graph("graph", compiled(kernels) if compiled else kernels, costs, costs.graph_launch_us))
    return [*program, Launch("after", host.after_us)]


def _split_kv_writes(rs: list[Region]) -> list[tuple[Region, list[Kernel]]]:
    """Each region with the K/V-write kernels that tc_piecewise runs in the attention island after it moved out of
    the graph region before it (at most two index_copy_ right before each attention call)."""
    out: list[tuple[Region, list[Kernel]]] = []
    for r in rs:
        moved: list[Kernel] = []
        if r.island is not None and r.island.name == ATTENTION_ISLAND and out and out[-1][0].island is None:
            prev = list(out[-1][0].kernels)
            while prev and len(moved) < 2 and prev[-1].op == _KV_WRITE_OP:
                moved.insert(0, prev.pop())
            out[-1] = (Region(tuple(prev)), out[-1][1])
        out.append((r, moved))
    return out


def tc_piecewise_program(trace: ForwardTrace, host: HostTimes, costs: Any, num_params: int,
                         compiled: Callable[[Sequence[Kernel]], list[Kernel]] | None = None) -> list[Launch]:
    """torch.compile piecewise: dynamo's guards once, then a Python call per piece (which replays its graph) and per
    island, whose K/V write runs eagerly."""
    rs = regions(trace)
    layer, fixed = _path(costs, "tc_piecewise")
    if layer is None:
        program = _outside(rs, host, host.load_us)
        program.append(Launch("guards", costs.tc_call_us(num_params)))
    else:  # the guards' fixed part is in the path's fixed cost, and a toy layer's parameters in its layer's
        toy = costs.path_params_per_layer * costs.guard_per_param_us
        layer = max(layer - toy, 0.0)
        # the path's per-forward cost less what is counted below: the piece no layer owns, the guards of the toy's
        # parameters outside its layers (this model's are all guarded below)
        counted = costs.piece_us + costs.path_params_fixed * costs.guard_per_param_us
        program = _outside(rs, host, host.load_us + max(fixed - counted, 0.0))
        program.append(Launch("guards", costs.guard_per_param_us * num_params))
    for r, moved in _split_kv_writes(rs):
        if r.island is None:
            if r.kernels:
                program.append(_graph("piece", compiled(r.kernels) if compiled else r.kernels, costs, costs.piece_us))
        else:
            # The island's call through its custom op on the real path: the measured layer minus its piece's call
            # and its K/V-write launches (counted below); else a piece call's cost stands in.
            overhead = costs.piece_us if layer is None else \
                max(layer - costs.piece_us - len(moved) * costs.eager_launch_us, 0.0)
            program += _island(r, host, overhead, moved, costs.eager_launch_us)
    return [*program, Launch("after", host.after_us)]
