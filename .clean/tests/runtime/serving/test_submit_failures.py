"""Engine.submit on the CPU when things fail: a failing forward fails only its own requests, a failing replay reruns
eagerly and answers alike, close with pending requests fails them clearly, and a pending request can be cancelled."""

from __future__ import annotations

import threading

import pytest
from engine_cache import random_prompts
from submit_helpers import BUCKETS, COMMON, engine, reference, same, shared, whole
from threads import wait_for

from bcg.runtime import Engine, EngineClosedError


# ---------------------------------------------------------------- failures
class Poisoned(RuntimeError):
    pass


def test_a_failing_forward_fails_only_its_own_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine("tiny-dense", "breakable")
    eng.prefix_cache.clear()
    real = eng.runner.forward
    failed_firsts: set[int] = set()

    def forward(batch):
        ids = batch.host_input_ids
        if 255 in ids:  # a poisoned token anywhere: this forward raises (replay and eager alike)
            failed_firsts.update(int(ids[s]) for s in batch.host_cu_seqlens_q[:-1])
            raise Poisoned("injected forward failure")
        return real(batch)

    monkeypatch.setattr(eng.runner, "forward", forward)
    # Eight tokens each, opening with its own token (so no prefix is shared): eight to a 64-token forward and none
    # chunked, so each failed forward names its requests by their first tokens.
    prompts = [[i, *p] for i, p in enumerate(random_prompts([7] * 40, seed=12, vocab=255))]
    for i in (3, 17, 30):
        prompts[i][5] = 255
    futures = [eng.submit(p) for p in prompts]
    failed = set()
    for i, (f, ref) in enumerate(zip(futures, reference(prompts))):
        exc = f.exception(timeout=60)
        if exc is not None:
            assert isinstance(exc, Poisoned), exc
            failed.add(i)
        else:
            assert same(f.result(), ref)
    assert failed == failed_firsts and {3, 17, 30} <= failed and len(failed) < len(prompts)
    monkeypatch.undo()
    assert whole(eng)


def test_a_failing_replay_reruns_eagerly_and_answers_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine("tiny-dense", "breakable")
    real, calls = eng.runner.backend.replay, {"n": 0}

    def replay(handle, n):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("transient island failure (injected)")
        real(handle, n)

    monkeypatch.setattr(eng.runner.backend, "replay", replay)
    prompts = shared(6, head=20, seed=13)
    results = [eng.submit(p).result(timeout=60) for p in prompts]
    monkeypatch.undo()
    assert all(same(r, ref) for r, ref in zip(results, reference(prompts)))
    assert any(b.reason == "replay_failed" for r in results for b in r.batches)
    for n in BUCKETS:  # the shared engine serves the next tests with every bucket
        if eng.telemetry.buckets[n].disabled_reason:
            eng.enable_bucket(n)


# ---------------------------------------------------------------- close and cancellation
def _blocked_engine(monkeypatch: pytest.MonkeyPatch) -> tuple[Engine, threading.Event, threading.Event]:
    """An engine of its own whose first forward waits until ``release`` is set (``entered`` says it started)."""
    eng = Engine("tiny-dense", backend="breakable", seed=0, progress=False, **COMMON)
    real, entered, release = eng.runner.forward, threading.Event(), threading.Event()

    def forward(batch):
        entered.set()
        assert release.wait(60)
        return real(batch)

    monkeypatch.setattr(eng.runner, "forward", forward)
    return eng, entered, release


def test_close_with_pending_requests_fails_them_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, entered, release = _blocked_engine(monkeypatch)
    with eng:
        first = eng.submit([1, 2, 3])
        assert entered.wait(60)
        pending = [eng.submit(p) for p in random_prompts([5, 9, 70], seed=14)]
        closer = threading.Thread(target=eng.close)
        closer.start()
        wait_for(lambda: eng._closed)
        release.set()
        closer.join(60)
        assert not closer.is_alive()
    assert first.result(timeout=10).logits.shape == (1, 256)  # launched before close: it completes
    for f in pending:
        with pytest.raises(EngineClosedError, match="closed before this request finished"):
            f.result(timeout=10)
    with pytest.raises(EngineClosedError):
        eng.submit([1, 2])
    with pytest.raises(EngineClosedError):
        eng.prefill([[1, 2]])
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots  # close cleared the cache
    eng.close()  # idempotent


def test_a_pending_request_can_be_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, entered, release = _blocked_engine(monkeypatch)
    with eng:
        first = eng.submit([1, 2, 3])
        assert entered.wait(60)
        victim, after = eng.submit([9] * 30), eng.submit([4, 5, 6])
        assert victim.cancel()
        release.set()
        assert first.result(timeout=60) and after.result(timeout=60)
        assert victim.cancelled()
        assert 30 not in [b.num_tokens for b in eng.telemetry.batches]
