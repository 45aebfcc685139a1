"""The differential check: every captured bucket replayed against eager at its padded shape."""

from __future__ import annotations

import pytest
import torch
from stand_ins import wrong_output

from bcg.runtime import Engine
from bcg.runtime.runner.verify import default_tolerance, verify_buckets, verify_segments


@pytest.mark.parametrize(("preset", "backend"), [("tiny-dense", "breakable"), ("tiny-moe", "breakable"),
                                                 ("tiny-dsa", "breakable"), ("tiny-dense", "full")])
def test_verify_passes_on_correct_graphs(preset: str, backend: str) -> None:
    eng = Engine(preset, backend=backend, device="cpu", buckets=[1, 8, 16], verify=True, progress=False,
                 max_requests=4)
    assert set(eng.runner.handles) == {1, 8, 16}
    assert all(eng.telemetry.buckets[n].verify_diff <= default_tolerance(backend, torch.float32) for n in (8, 16))
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots  # the check leaves no slot allocated


def test_a_graph_that_replays_wrong_is_disabled() -> None:
    eng = Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8, 16], progress=False)
    steps = eng.runner.handles[16]._replay_fns
    steps.pop()  # drop the last segment: the replay silently skips the final layer's MLP and the output copy
    diffs = verify_buckets(eng.runner)
    assert diffs[8] == 0.0 and diffs[16] > 0.0
    assert 16 not in eng.runner.handles and "verify failed" in eng.telemetry.buckets[16].disabled_reason
    ref = Engine("tiny-dense", backend="eager", device="cpu", progress=False)
    res = eng.prefill([[3] * 12])
    assert res.batches[0].reason == "bucket_disabled"
    assert (res.logits - ref.prefill([[3] * 12]).logits).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------------ segment by segment
def _segments(handle):
    """(graph segments, eager steps) of a breakable handle, in replay order."""
    from bcg.graph import EagerStep

    steps = handle.steps
    return [s for s in steps if not isinstance(s, EagerStep)], [s for s in steps if isinstance(s, EagerStep)]


def _engine(preset: str = "tiny-dense", backend: str = "breakable") -> Engine:
    return Engine(preset, backend=backend, device="cpu", buckets=[8, 16], progress=False, max_requests=4)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_segment_check_finds_no_divergence_in_correct_graphs(preset: str) -> None:
    eng = _engine(preset)
    report = verify_segments(eng.runner, 12)
    segments, islands = _segments(eng.runner.handles[16])
    assert report.ok and report.bucket == 16 and report.first_divergence is None
    assert {c.index for c in report.checks if c.kind == "segment"} == set(range(len(segments)))
    assert {c.index for c in report.checks if c.kind == "island"} == set(range(len(islands)))
    assert report.max_diff == 0.0 and "no divergence" in str(report)
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots


def test_segment_check_names_the_segment_that_diverges() -> None:
    eng = _engine()
    segments, islands = _segments(eng.runner.handles[16])
    seg, real = segments[1], segments[1].replay
    q = next(a for a in islands[1].args if isinstance(a, torch.Tensor))  # what segment 1 hands island 1

    def faulty() -> None:  # segment 1 computes island 1's inputs, then goes wrong
        real()
        q[:3].add_(0.5)

    handle = eng.runner.handles[16]
    seg.replay = handle._replay_fns[handle.steps.index(seg)] = faulty  # what replay() and the step-through call
    report = verify_segments(eng.runner, 12)
    bad = report.first_divergence
    assert not report.ok and (bad.kind, bad.index) == ("segment", 1)
    assert report.island_before == f"{islands[0].name}#0" and bad.feeds == f"{islands[1].name}#1"
    assert bad.max_abs_diff == pytest.approx(0.5, rel=1e-4)
    text = str(report)
    assert "segment 1" in text and f"{islands[0].name}#0" in text and "0.5" in text
    # the plain check agrees that the bucket is wrong, but cannot say where
    assert verify_buckets(eng.runner)[16] > 0.0


def test_segment_check_blames_an_island_whose_inputs_matched() -> None:
    eng = _engine()
    _, islands = _segments(eng.runner.handles[16])
    step = islands[1]
    step.fn = wrong_output(step.fn, rows=2, factor=3.0)  # replay only: the eager run calls the model's island
    report = verify_segments(eng.runner, 12)
    bad = report.first_divergence
    assert (bad.kind, bad.index, bad.name) == ("island", 1, f"{step.name}#1")
    assert report.island_before == f"{step.name}#1"


def test_segment_check_of_a_whole_graph_backend_compares_the_output() -> None:
    eng = _engine(backend="full")
    report = verify_segments(eng.runner, 12)
    assert report.ok and [c.kind for c in report.checks] == ["segment"] and report.checks[0].feeds == "output"
    with pytest.raises(ValueError, match="does not replay a graph"):
        verify_segments(eng.runner, 100)
