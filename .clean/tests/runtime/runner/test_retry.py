"""Replay failures over an engine's life: transient ones are retried, repeated ones disable the bucket (recorded,
logged once, visible in telemetry), a disabled bucket can be re-enabled or recaptured, and batches move up the
ladder past it."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_cache import EngineCache, random_prompts

from bcg.graph import EagerStep
from bcg.runtime import Engine

reference = EngineCache(device="cpu", chunked_prefill_size=64, kv_tokens=512)


class Flaky:
    """Makes the first island of a breakable handle raise on its next ``failures`` replays."""

    def __init__(self, handle, failures: int) -> None:
        self.step = next(s for s in handle.steps if isinstance(s, EagerStep))
        self.fn, self.failures, self.calls = self.step.fn, failures, 0
        self.step.fn = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("transient island failure (injected)")
        return self.fn(*args, **kwargs)


def _engine(**kw) -> Engine:
    return Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8, 16, 32], chunked_prefill_size=64,
                  kv_tokens=512, progress=False, **kw)


def _check(eng: Engine, lengths: list[int]):
    batch = random_prompts(lengths, seed=sum(lengths))
    res = eng.prefill(batch)
    assert (res.logits - reference("tiny-dense", "eager").prefill(batch).logits).abs().max().item() <= 1e-5
    return res.batches[0]


def test_one_transient_replay_failure_does_not_disable_the_bucket() -> None:
    eng = _engine()
    flaky = Flaky(eng.runner.handles[16], failures=1)
    assert _check(eng, [13]).reason == "replay_failed"
    rec = eng.telemetry.buckets[16]
    assert rec.disabled_reason is None and rec.consecutive_failures == 1 and rec.num_replay_failures == 1
    assert "transient island failure" in rec.last_failure
    again = _check(eng, [13])
    assert (again.graph_used, again.bucket, again.reason) == (True, 16, "graph") and flaky.calls == 2
    assert rec.consecutive_failures == 0 and rec.num_replay_failures == 1


def test_repeated_failures_disable_the_bucket_once_and_batches_move_up(caplog: pytest.LogCaptureFixture) -> None:
    eng = _engine(max_replay_failures=3)
    Flaky(eng.runner.handles[16], failures=10**6)
    with caplog.at_level(logging.WARNING, logger="bcg"):
        reasons = [_check(eng, [13]).reason for _ in range(3)]
        assert reasons == ["replay_failed"] * 3
        rec = eng.telemetry.buckets[16]
        assert rec.disabled_reason is not None and "3 replays in a row" in rec.disabled_reason
        moved = _check(eng, [13])  # 16 is disabled: the next healthy bucket within the padding rule
        assert (moved.graph_used, moved.bucket) == (True, 32)
        _check(eng, [14])
    assert sum("bucket 16 disabled" in r.getMessage() for r in caplog.records) == 1
    as_dict = {b["bucket"]: b for b in eng.telemetry.to_dict()["buckets"]}
    assert as_dict[16]["num_replay_failures"] == 3 and as_dict[16]["disabled_reason"] == rec.disabled_reason
    assert 16 not in eng.runner.handles


def test_a_disabled_bucket_can_be_reenabled_or_recaptured() -> None:
    eng = _engine(max_replay_failures=1)
    flaky = Flaky(eng.runner.handles[16], failures=1)
    assert _check(eng, [13]).reason == "replay_failed"
    assert eng.telemetry.buckets[16].disabled_reason is not None
    eng.enable_bucket(16)  # the fault was transient: the captured graph is still good
    assert _check(eng, [13]).bucket == 16 and flaky.calls == 2
    assert eng.telemetry.buckets[16].disabled_reason is None

    Flaky(eng.runner.handles[16], failures=10**6)  # a fault inside the captured graph itself: recapture
    assert _check(eng, [13]).reason == "replay_failed"
    old = eng.runner.table.buckets[16].handle
    record = eng.recapture(16)
    assert record.disabled_reason is None and record.consecutive_failures == 0
    assert eng.runner.handles[16] is not old
    res = _check(eng, [13])
    assert (res.graph_used, res.bucket) == (True, 16)
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots


def test_enabling_a_bucket_without_a_graph_says_to_recapture(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.runtime.backends.breakable import BreakableBackend

    original = BreakableBackend.capture
    fail = {"on": True}

    def capture(self, n):
        if n == 16 and fail["on"]:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return original(self, n)

    monkeypatch.setattr(BreakableBackend, "capture", capture)
    eng = _engine()
    with pytest.raises(ValueError, match="recapture"):
        eng.enable_bucket(16)
    with pytest.raises(ValueError, match="no bucket 12"):
        eng.enable_bucket(12)
    fail["on"] = False
    assert eng.recapture(16).disabled_reason is None
    assert _check(eng, [13]).bucket == 16


def test_retry_policy_is_an_engine_option() -> None:
    with pytest.raises(ValueError, match="max_replay_failures"):
        _engine(max_replay_failures=0)
    assert _engine(max_replay_failures=5).runner.table.max_replay_failures == 5


def test_an_interrupted_recapture_leaves_the_bucket_disabled_not_half_captured(monkeypatch) -> None:
    from bcg.runtime.backends.breakable import BreakableBackend

    eng = _engine()
    real = BreakableBackend.capture

    def interrupted(self, bucket):
        raise KeyboardInterrupt

    monkeypatch.setattr(BreakableBackend, "capture", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.recapture(16)
    record = eng.telemetry.buckets[16]
    assert record.disabled_reason is not None and "interrupted" in record.disabled_reason
    assert 16 not in eng.runner.handles
    with pytest.raises(ValueError, match="recapture"):
        eng.enable_bucket(16)  # no graph to enable: it says to recapture
    # The next batches never meet a bucket without a graph: they move up the ladder (no replay fails).
    moved = _check(eng, [9, 4])
    assert (moved.bucket, moved.graph_used) == (32, True)
    monkeypatch.setattr(BreakableBackend, "capture", real)
    assert eng.recapture(16).disabled_reason is None
    assert _check(eng, [9, 4]).bucket == 16
