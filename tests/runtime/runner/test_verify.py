"""The differential check: every captured bucket replayed against eager at its padded shape."""

from __future__ import annotations

import pytest
import torch

from bcg.runtime import Engine
from bcg.runtime.runner.verify import default_tolerance, verify_buckets


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
