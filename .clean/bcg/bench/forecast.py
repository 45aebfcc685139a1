"""What each backend would do with this model on this machine, before anything is captured or compiled: whether it
can run the model, its prefill latency at each length, and for a bucket ladder its resident graph memory and build
time.

A :class:`Forecast` is made per variant (``breakable``, ``full+fused``, ``tc_piecewise``, ``breakable+inductor``, ...)
from the :class:`Profiled` forwards of its kernels setting (one per size: the eager trace, the step under the static
attention, the host times, the activation peak) and :class:`~bcg.bench.machine.MachineCosts`. The latency of one
replayed forward at each profiled size is its program (:mod:`bcg.bench.predict`) simulated; between sizes it is
interpolated. The estimates, each stated in DESIGN.md:

* graph memory = the pool (the activation peak of the largest bucket's forward: one pool serves every bucket, largest
  first) + per bucket, its kernel nodes and graph executables at the measured bytes each; tc_piecewise also keeps
  every piece's outputs per bucket alive (the tensors crossing its islands, per token);
* build time = per bucket, ``warmup`` eager forwards, one capture (the eager forward's host time plus the measured
  capture cost per node and per graph), plus the compile when the variant compiles (the measured fixed cost of a
  compile and its cost per kernel).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bcg.bench.amdahl import interpolate
from bcg.bench.predict import (
    ATTENTION_ISLAND,
    HostTimes,
    Launch,
    breakable_program,
    full_program,
    fuse,
    simulate,
    tc_piecewise_program,
)
from bcg.bench.trace import ForwardTrace, island_names
from bcg.bench.variants import Variant, parse_variant

__all__ = ["Forecast", "ForecastContext", "Profiled", "availability", "forecast", "island_group"]

# The islands torch.compile sees as opaque custom ops (bcg.ops.custom_ops), and those a piecewise graph splits at.
COMPILABLE_ISLANDS = frozenset({ATTENTION_ISLAND, "select_topk", "sparse_attention"})
SPLIT_ISLANDS = frozenset({ATTENTION_ISLAND})
GRAPH_PARTS = ("segment", "graph", "piece")


@dataclass
class Profiled:
    """Everything measured of one eager forward of ``size`` tokens at one kernels setting.

    ``full_trace`` is the step run under the static attention of ``full`` (None with ``full_error`` when that run
    failed: the reason ``full`` cannot capture the model); ``full_islands`` the islands called during it (a
    whole-step graph would hold them). Activation peaks are bytes above the resident memory (None if unknown).
    """

    size: int
    trace: ForwardTrace
    host: HostTimes
    full_trace: ForwardTrace | None = None
    full_error: str | None = None
    full_islands: list[str] = field(default_factory=list)
    activation_bytes: float | None = None
    full_activation_bytes: float | None = None
    trace_low: ForwardTrace | None = None  # each kernel at its lowest / highest device time over the profiles
    trace_high: ForwardTrace | None = None
    full_trace_low: ForwardTrace | None = None
    full_trace_high: ForwardTrace | None = None
    profiles: int = 1  # profiles the traces combine

    def bound(self, side: str) -> Profiled:
        """This forward with every input at its ``"low"`` or ``"high"`` end (the median where none was measured)."""
        return replace(self, trace=getattr(self, f"trace_{side}") or self.trace,
                       host=getattr(self.host, side) or self.host,
                       full_trace=getattr(self, f"full_trace_{side}") or self.full_trace)


@dataclass(frozen=True)
class ForecastContext:
    """What every forecast of a run shares: the machine, how the engines would be built, the model's size."""

    costs: Any  # MachineCosts
    emulated: bool
    tc_compiler: str
    num_params: int
    warmup: int = 2  # EngineConfig.warmup: eager forwards per bucket before its capture


@dataclass
class Forecast:
    """One variant's prediction: available or why not, then per profiled size the replayed forward's latency (and its
    interval: ``replay_low_ms`` / ``replay_high_ms``) and breakdown (ms; ``parts``: host and device µs per part), the
    kernel nodes and graphs each bucket holds."""

    variant: str
    available: bool
    reason: str | None = None
    replay_ms: dict[int, float] = field(default_factory=dict)
    replay_low_ms: dict[int, float] = field(default_factory=dict)  # the same with every input at its low / high end
    replay_high_ms: dict[int, float] = field(default_factory=dict)
    parts: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    nodes: dict[int, int] = field(default_factory=dict)
    graphs: dict[int, int] = field(default_factory=dict)
    activation: dict[int, float] = field(default_factory=dict)
    piece_bytes_per_token: float = 0.0
    compile_ms: float = 0.0

    def replay_at(self, bucket: int) -> float:
        """Predicted latency of one prefill that replays ``bucket`` (interpolated between profiled sizes)."""
        return interpolate(sorted(self.replay_ms.items()), bucket)

    def interval_at(self, bucket: int) -> tuple[float, float]:
        """(low, high) of :meth:`replay_at`: the replay played with every measured input at the low and at the high
        end of its spread (the median's own value where no spread was measured)."""
        mid = self.replay_at(bucket)
        low = interpolate(sorted(self.replay_low_ms.items()), bucket) if self.replay_low_ms else mid
        high = interpolate(sorted(self.replay_high_ms.items()), bucket) if self.replay_high_ms else mid
        return min(low, mid), max(high, mid)

    def graph_memory_bytes(self, buckets: Sequence[int], costs: Any) -> float:
        """Resident graph memory of a ladder ``buckets`` (see the module doc)."""
        if not buckets or not self.nodes:  # nothing to hold, or unavailable (no forecast)
            return 0.0
        sizes = sorted(self.nodes)
        pool = interpolate([(s, self.activation.get(s, 0.0)) for s in sizes], max(buckets), scale_past_end=True)
        nodes = sum(interpolate([(s, self.nodes[s]) for s in sizes], b) for b in buckets)
        graphs = sum(interpolate([(s, self.graphs[s]) for s in sizes], b) for b in buckets)
        return pool + nodes * costs.graph_node_bytes + graphs * costs.graph_bytes + \
            self.piece_bytes_per_token * sum(buckets)

    def build_ms(self, buckets: Sequence[int], eager: Callable[[int], tuple[float, float]], costs: Any,
                 warmup: int) -> float:
        """Build time of a ladder: per bucket ``warmup`` eager forwards and a capture, plus the compile. ``eager(b)``
        is the eager forward's (wall ms, host ms) at ``b`` tokens."""
        sizes = sorted(self.nodes)
        total = self.compile_ms
        for b in buckets:
            wall, host = eager(b)
            nodes = interpolate([(s, self.nodes[s]) for s in sizes], b)
            graphs = interpolate([(s, self.graphs[s]) for s in sizes], b)
            capture = host + (nodes * max(costs.capture_per_node_us - costs.eager_launch_us, 0.0)
                              + graphs * costs.capture_per_graph_us) / 1e3
            total += warmup * wall + capture
        return total


def island_group(name: str) -> str:
    """An island's name with its layer indices replaced by ``*``, so one module class reads as one row.

    Example::

        >>> island_group("auto_island[model.layers.3.mlp.experts]")
        'auto_island[model.layers.*.mlp.experts]'
    """
    return re.sub(r"\.\d+(?=[.\]])", ".*", name)


def availability(variant: Variant, islands: Sequence[str], full_error: str | None, full_islands: Sequence[str],
                 emulated: bool) -> str | None:
    """Why ``variant`` cannot run this model (a sentence), or None; judged from the eager forward's islands and the
    static-attention run, as the backends themselves would refuse at build time.

    Example::

        >>> availability(parse_variant("tc_piecewise"), ["attention_island", "select_topk"], None, [], False)[:60]
        "backend 'tc_piecewise' cannot capture this model: the island"
    """
    name = variant.backend
    if variant.full_graph_tokens != 0:
        return ("+full is not predicted: which of a bucket's two graphs a batch replays depends on its request mix; "
                "measure it with bcg bench --backends breakable+fused,breakable+fused+full")
    if name in ("eager", "breakable") and variant.compile is None:
        return None
    if name == "full":
        if full_error is not None:
            return f"backend 'full' cannot capture this model: {full_error.rstrip('. ')}"
        if full_islands:
            return (f"backend 'full' cannot capture this model: the island {island_group(full_islands[0])} would run "
                    "inside its whole-step graph, which cannot hold it")
    if name == "tc_piecewise":
        if emulated and variant.tc_compiler == "inductor":
            return ("backend 'tc_piecewise' cannot capture this model: tc_compiler='inductor' cannot run under the "
                    "CPU graph emulation (use tc_compiler='traced' on a CPU, or a GPU)")
        inside = [i for i in islands if i not in SPLIT_ISLANDS]
        if inside:
            return (f"backend 'tc_piecewise' cannot capture this model: the island {island_group(inside[0])} is not "
                    "a split point, so a piece would capture it")
    if variant.compile is not None:
        if emulated and variant.compile == "inductor":
            return ("compile='inductor' cannot run under the CPU graph emulation (use compile='traced' on a CPU, or "
                    "a GPU)")
        opaque = [i for i in islands if i not in COMPILABLE_ISLANDS]
        if opaque:
            return (f"compile={variant.compile!r} would fail: torch.compile cannot trace the island "
                    f"{island_group(opaque[0])} (it has no custom-op stand-in)")
    return None


def _program(variant: Variant, p: Profiled, ctx: ForecastContext) -> list[Launch]:
    compiled = fuse if _compiles(variant) else None
    if variant.backend == "breakable":
        return breakable_program(p.trace, p.host, ctx.costs, compiled)
    if variant.backend == "full":
        assert p.full_trace is not None
        return full_program(p.full_trace, p.host, ctx.costs, compiled)
    if variant.backend == "tc_piecewise":
        return tc_piecewise_program(p.trace, p.host, ctx.costs, ctx.num_params, compiled)
    raise ValueError(f"no program for backend {variant.backend!r}")


def _compile_ms(variant: Variant, kernels: int, ctx: ForecastContext) -> float:
    """The compile's fixed cost once plus its cost per kernel: compile= compiles the layer stack once (dynamic token
    dimension); tc_piecewise compiles every piece, but the pieces of repeated layers are one graph to the compiler's
    caches, so it costs about what the whole stack does."""
    compiler = variant.tc_compiler if variant.backend == "tc_piecewise" else variant.compile
    if compiler is None:
        return 0.0
    fixed, per_kernel = ctx.costs.compile_ms.get(compiler, (0.0, 0.0))
    return fixed + per_kernel * kernels


def forecast(name: str, profiles: dict[int, Profiled], ctx: ForecastContext) -> Forecast:
    """The :class:`Forecast` of variant ``name`` from the profiled forwards of its kernels setting (by size).

    Example::

        fc = forecast("breakable", profiles, ForecastContext(costs, emulated=False, tc_compiler="inductor",
                                                            num_params=300))
        fc.available, fc.replay_at(512), fc.graph_memory_bytes(default_ladder(2048), costs)
    """
    variant = parse_variant(name, ctx.tc_compiler)
    any_p = next(iter(profiles.values()))
    islands = list(dict.fromkeys(i for p in profiles.values() for i in island_names(p.trace)))
    full_islands = list(dict.fromkeys(i for p in profiles.values() for i in p.full_islands))
    full_error = next((p.full_error for p in profiles.values() if p.full_error), None)
    reason = availability(variant, islands, full_error, full_islands, ctx.emulated)
    fc = Forecast(variant.name, reason is None, reason)
    if reason is not None:
        return fc
    for size, p in sorted(profiles.items()):
        played = simulate(_program(variant, p, ctx))
        fc.replay_ms[size] = played.wall_ms
        fc.replay_low_ms[size] = simulate(_program(variant, p.bound("low"), ctx)).wall_ms
        fc.replay_high_ms[size] = simulate(_program(variant, p.bound("high"), ctx)).wall_ms
        fc.parts[size] = played.parts
        graph_parts = [v for k, v in played.parts.items() if k in GRAPH_PARTS]
        fc.graphs[size] = sum(int(v["count"]) for v in graph_parts)
        fc.nodes[size] = sum(int(v["nodes"]) for v in graph_parts)
        full = variant.backend == "full"
        fc.activation[size] = (p.full_activation_bytes if full else p.activation_bytes) or 0.0
    if variant.backend == "tc_piecewise" or variant.compile is not None:
        # Every piece's outputs stay alive per bucket: the tensors crossing each island. A compiled layer stack's
        # regions allocate theirs per bucket too (the uncompiled stack shares one set of bridge buffers); on the H200
        # breakable+inductor held 4-6 GiB on llama-dense, gptoss-moe and the Qwen3 shape where this was left out.
        fc.piece_bytes_per_token = sum(any_p.host.island_bytes.get(n, 0.0) * any_p.host.island_calls.get(n, 0)
                                       for n in any_p.host.island_bytes) / max(any_p.size, 1)
    largest = max(profiles)
    fc.compile_ms = _compile_ms(variant, len(profiles[largest].trace.kernels), ctx)
    return fc


def _compiles(variant: Variant) -> bool:
    """Whether the variant's graphs run Inductor's kernels (its layer stack compiled, or tc_piecewise's pieces)."""
    return variant.compile == "inductor" or (variant.backend == "tc_piecewise" and variant.tc_compiler == "inductor")
