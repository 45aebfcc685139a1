"""A program of host and device work, played on one host and one in-order device (the two-clock pipeline a CUDA
stream is), and a program rebuilt from a played one's per-part totals.

:mod:`bcg.bench.predict` composes each backend's prefill as a list of :class:`Launch` steps; :func:`simulate` plays
it: each step takes host time, and a step that enqueues device work starts it when both the host has issued it and the
device has finished what came before, so the wall time is whichever clock finishes last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Launch", "Played", "program_from_parts", "simulate"]


@dataclass(frozen=True)
class Launch:
    """One step of a program: ``host_us`` of host work, then (``on_device``) ``device_us`` of device work it
    enqueues. ``part`` names what it is ("outside", "segment", "island:<name>", "piece", ...); a graph launch holds
    ``nodes`` kernel nodes."""

    part: str
    host_us: float
    device_us: float = 0.0
    on_device: bool = False
    nodes: int = 0


@dataclass
class Played:
    """A simulated program: its wall time, the host and device time it took, and both per part."""

    wall_us: float
    host_us: float
    device_us: float
    parts: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def wall_ms(self) -> float:
        return self.wall_us / 1e3


def simulate(program: Sequence[Launch]) -> Played:
    """Plays ``program`` on one host and one in-order device; returns when both are done.

    Example::

        >>> p = simulate([Launch("a", 10.0, 5.0, True), Launch("b", 1.0, 50.0, True), Launch("c", 2.0)])
        >>> p.wall_us, p.host_us, p.device_us
        (65.0, 13.0, 55.0)
    """
    host = device = busy = 0.0
    parts: dict[str, dict[str, float]] = {}
    for step in program:
        if step.host_us < 0 or step.device_us < 0:
            raise ValueError(f"negative time in program step {step}")
        host += step.host_us
        part = parts.setdefault(step.part, {"host_us": 0.0, "device_us": 0.0, "count": 0, "nodes": 0})
        part["host_us"] += step.host_us
        part["count"] += 1
        part["nodes"] += step.nodes
        if step.on_device:
            device = max(device, host) + step.device_us
            busy += step.device_us
            part["device_us"] += step.device_us
    return Played(max(host, device), host, busy, parts)


_GRAPH_PARTS = ("segment", "piece", "graph")


def program_from_parts(parts: dict[str, dict[str, float]]) -> list[Launch]:
    """A program rebuilt from a played one's per-part totals (``Played.parts``, as results.json keeps them for the
    representative length): each part's steps share its host and device time evenly, the graph launches alternate
    with the island steps as the forward alternates them, ``outside`` and ``guards`` come first and ``after`` last.
    What the replay of a saved analysis plays (tests/bench/test_analyze_evidence.py).

    Example::

        >>> parts = {"outside": {"host_us": 10.0, "device_us": 0.0, "count": 1, "nodes": 0},
        ...          "segment": {"host_us": 4.0, "device_us": 60.0, "count": 2, "nodes": 6},
        ...          "island:attention_island": {"host_us": 30.0, "device_us": 5.0, "count": 1, "nodes": 0}}
        >>> [(s.part, s.host_us, s.device_us) for s in program_from_parts(parts)]
        [('outside', 10.0, 0.0), ('segment', 2.0, 30.0), ('island:attention_island', 30.0, 5.0), ('segment', 2.0, 30.0)]
    """
    def steps(name: str) -> list[Launch]:
        p = parts[name]
        n = max(int(p["count"]), 1)
        return [Launch(name, p["host_us"] / n, p["device_us"] / n, p["device_us"] > 0, int(p.get("nodes", 0)) // n)
                for _ in range(n)]

    first = [s for name in ("outside", "guards") if name in parts for s in steps(name)]
    graphs = [s for name in parts if name in _GRAPH_PARTS for s in steps(name)]
    islands = [s for name in parts if name.startswith("island:") for s in steps(name)]
    body: list[Launch] = []
    gaps = max(len(graphs) - 1, 1)
    for i, g in enumerate(graphs):
        body.append(g)
        if i < gaps:  # the island steps of the i-th break
            body += islands[len(islands) * i // gaps: len(islands) * (i + 1) // gaps]
    if not graphs:
        body = islands
    after = steps("after") if "after" in parts else []
    return [*first, *body, *after]
