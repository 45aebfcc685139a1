"""The segment-by-segment differential check: where a breakable graph's replay first departs from eager.

A breakable graph replays segments and eager islands in turn. Stepping through its
:attr:`~bcg.graph.BreakableCUDAGraph.steps` shows what each step hands the next: a segment's outputs are the inputs of
the island after it (or the final output), an island's outputs are the arguments it writes and what it returns. The
eager run of the same padded inputs, under the same forward context, records the same islands
(:func:`bcg.recording.record_eager_calls`), so the two can be compared at every island boundary. An argument the
eager island overwrites is an output of that island; the others are inputs, produced by the segment before it.

Only what crosses an island is observed: a tensor a segment hands a later segment directly (the residual stream) is
seen where it first reaches an island's inputs or the output, so the divergence is reported where it is first
visible. :func:`bcg.runtime.runner.verify.verify_segments` is the entry point.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from bcg.graph import BreakableCUDAGraph, EagerStep
from bcg.recording import EagerCall, record_eager_calls, snapshot
from bcg.tensors import tensor_leaves

if TYPE_CHECKING:
    from bcg.runtime.runner.runner import Runner

__all__ = ["SegmentCheck", "SegmentReport", "compare_segments"]


@dataclass
class SegmentCheck:
    """One observation point: the outputs of a segment or of an island, compared with eager.

    Attributes:
        kind: "segment" (a graph segment's outputs: the next island's inputs, or the final output) or "island"
            (the arguments an island wrote and what it returned).
        index: the segment's number among the graph's segments, or the island's among its islands.
        name: "segment 3" or "attention#1" (island name and number).
        feeds: what these outputs are read by next: an island's name, "segment N" or "output".
        max_abs_diff: max |replay - eager| over the compared tensors (inf when their shapes differ).
        rel_diff: ``max_abs_diff`` relative to the largest |eager| value.
        ok: ``rel_diff`` within the tolerance.
    """

    kind: str
    index: int
    name: str
    feeds: str
    max_abs_diff: float
    rel_diff: float
    ok: bool


@dataclass
class SegmentReport:
    """The segment-by-segment comparison of one bucket; ``str(report)`` is readable, ``to_dict()`` is JSON."""

    backend: str
    bucket: int
    num_tokens: int
    tolerance: float
    checks: list[SegmentCheck] = field(default_factory=list)
    note: str | None = None

    @property
    def ok(self) -> bool:
        """No check diverged."""
        return all(c.ok for c in self.checks)

    @property
    def first_divergence(self) -> SegmentCheck | None:
        """The first check, in replay order, whose outputs diverge; None when the graph matches eager."""
        return next((c for c in self.checks if not c.ok), None)

    @property
    def island_before(self) -> str | None:
        """The island that ran last before the first divergence was observed (the island itself when its own
        outputs diverge); None without a divergence or when it is in the first segment."""
        bad = self.first_divergence
        if bad is None:
            return None
        if bad.kind == "island":
            return bad.name
        before = [c for c in self.checks[: self.checks.index(bad)] if c.kind == "island"]
        return before[-1].name if before else None

    @property
    def max_diff(self) -> float:
        """The largest absolute difference over every check."""
        return max((c.max_abs_diff for c in self.checks), default=0.0)

    def __str__(self) -> str:
        head = f"bucket {self.bucket} ({self.num_tokens} tokens, {self.backend})"
        bad = self.first_divergence
        if bad is None:
            text = f"{head}: no divergence in {len(self.checks)} checks (max |diff| {self.max_diff:.3g})"
        else:
            after = f" after island {self.island_before}" if bad.kind == "segment" and self.island_before else ""
            text = (f"{head}: diverges at {bad.name}{after}, whose outputs feed {bad.feeds}: max |diff| "
                    f"{bad.max_abs_diff:.3g} (relative {bad.rel_diff:.3g}, tolerance {self.tolerance:.3g})")
            upto = self.checks[: self.checks.index(bad) + 1][-4:]
            text += "".join(f"\n  {c.name:>20} -> {c.feeds:<20} max |diff| {c.max_abs_diff:.3g}"
                            f"{'' if c.ok else '  <- first divergence'}" for c in upto)
        return text + (f"\n  note: {self.note}" if self.note else "")

    def to_dict(self) -> dict[str, Any]:
        bad = self.first_divergence
        return {"backend": self.backend, "bucket": self.bucket, "num_tokens": self.num_tokens, "ok": self.ok,
                "tolerance": self.tolerance, "max_diff": self.max_diff, "island_before": self.island_before,
                "first_divergence": asdict(bad) if bad else None, "checks": [asdict(c) for c in self.checks],
                "note": self.note}


def _diff(replay: list[torch.Tensor], eager: list[torch.Tensor]) -> tuple[float, float]:
    """(max |replay - eager|, max |eager|) over paired tensors; NaN matching NaN counts as equal."""
    if len(replay) != len(eager) or any(a.shape != b.shape for a, b in zip(replay, eager)):
        return float("inf"), 1.0
    worst, scale = 0.0, 0.0
    for a, b in zip(replay, eager):
        if a.numel() == 0:
            continue
        a, b = a.float(), b.float()
        d = torch.where(a.isnan() & b.isnan(), 0.0, (a - b).abs()).nan_to_num(nan=float("inf"))
        worst = max(worst, d.max().item())
        scale = max(scale, b.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max().item())
    return worst, scale


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() \
        else a.shape == b.shape and bool(torch.equal(a, b))


class _Checks:
    def __init__(self, tolerance: float) -> None:
        self.tolerance, self.items = tolerance, []

    def add(self, kind: str, index: int, name: str, feeds: str, replay: list, eager: list) -> None:
        worst, scale = _diff(replay, eager)
        rel = worst / max(scale, 1e-12)
        self.items.append(SegmentCheck(kind, index, name, feeds, worst, rel, rel <= self.tolerance))


def _step_through(handle: BreakableCUDAGraph, calls: list[EagerCall], output: torch.Tensor, eager_out: torch.Tensor,
                  n: int, checks: _Checks) -> None:
    steps, labels = handle.steps, []
    for step in steps:  # (kind, index, name) of every step, in replay order
        kind = "island" if isinstance(step, EagerStep) else "segment"
        index = sum(k == kind for k, _, _ in labels)
        labels.append((kind, index, f"{step.name}#{index}" if kind == "island" else f"segment {index}"))
    producer = ("inputs", -1, "graph inputs")  # whose outputs the next island reads
    for i, step in enumerate(steps):
        kind, index, name = labels[i]
        feeds = labels[i + 1][2] if i + 1 < len(steps) else "output"
        if kind == "segment":
            step.replay()
        else:
            ref, args = calls[index], (step.args, step.kwargs)
            written = [not _same(b, a) for b, a in zip(ref.before, ref.after)]
            before = snapshot(args)
            checks.add(*producer, name, [t for t, w in zip(before, written) if not w],
                       [t for t, w in zip(ref.before, written) if not w])
            step()
            outs = [t for t, w in zip(snapshot(args), written) if w] + snapshot(tensor_leaves(step.boundary.value))
            checks.add(kind, index, name, feeds, outs, [t for t, w in zip(ref.after, written) if w] + ref.results)
        producer = labels[i]
    checks.add(*producer, "output", [output[:n]], [eager_out[:n]])


def compare_segments(runner: Runner, handle: Any, bucket: int, num_tokens: int, tolerance: float) -> SegmentReport:
    """The comparison behind :func:`~bcg.runtime.runner.verify.verify_segments`, with the batch loaded into the
    static buffers of ``bucket`` and its forward context installed (inside ``runner.replay_context``)."""
    # The step reads only the bucket's fields, which neither run writes: the replay starts from the same inputs.
    with record_eager_calls() as calls:
        runner.run_step_eagerly(bucket)
    eager_out = runner.static_output[:num_tokens].clone()
    report = SegmentReport(runner.config.backend, bucket, num_tokens, tolerance)
    checks = _Checks(tolerance)
    islands = [s.name for s in handle.steps if isinstance(s, EagerStep)] if isinstance(
        handle, BreakableCUDAGraph) else None
    if islands is not None and islands == [c.name for c in calls]:
        _step_through(handle, calls, runner.static_output, eager_out, num_tokens, checks)
    else:
        runner.backend.replay(handle, bucket)
        checks.add("segment", 0, "graph", "output", [runner.static_output[:num_tokens]], [eager_out])
        report.note = ("a breakable graph whose islands differ from the eager run's (debug mode?): only the output "
                       "is compared") if islands is not None else (
            f"a {runner.config.backend} handle is not a breakable graph: only its output is compared")
    report.checks = checks.items
    return report
