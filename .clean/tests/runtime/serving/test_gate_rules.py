"""The gate's rules (DESIGN.md, "Who waits for whom"), one test each, and the interleavings a server meets that once
hung: recapture while a prefill waits for slots, close/recapture from done-callbacks, an interrupt out of a served
forward, a hit ending inside a cached node, close racing the first submit, a cancelled asubmit.

Every wait runs on a thread of its own joined with a timeout, so a hang fails the test instead of blocking CI."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from engine_cache import random_prompts
from gate_helpers import SMALL, hold_first_served_forward, same, stopped
from threads import HANG_S, finishes, in_thread, wait_for

import bcg.runtime.engine as engine_module
from bcg.runtime import Engine, EngineClosedError
from bcg.runtime.serving import ActivityGate


# ---------------------------------------------------------------- rule 1: a recapture waits for forwards only
def test_recapture_while_a_prefill_waits_for_slots_a_served_request_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The served request (60 of 80 slots, four chunks) holds what the prefill needs (24); the recapture (a dummy
    batch of 16) must not wait for the waiting prefill, because the request's next chunk waits for the recapture."""
    eng = Engine("tiny-dense", backend="breakable", prefix_cache=False, **{**SMALL, "kv_tokens": 80})
    entered, go = hold_first_served_forward(eng, monkeypatch)
    long, short = random_prompts([60, 24], seed=3)
    served = eng.submit(long)
    assert entered.wait(HANG_S)
    prefill, prefilled = in_thread(lambda: eng.prefill([short]))
    time.sleep(0.2)  # the prefill now waits for slots
    assert eng._gate.num_active == 1  # the served forward only: a prefill waiting for slots is not in flight
    recapture, recaptured = in_thread(lambda: eng.recapture(16))
    time.sleep(0.1)
    go.set()
    finishes(recapture, "recapture")
    finishes(prefill, "prefill")
    assert recaptured["result"].disabled_reason is None
    assert same(served.result(timeout=HANG_S), long) and same(prefilled["result"], short)
    closer, _ = in_thread(eng.close)
    finishes(closer, "close")


# ---------------------------------------------------------------- rule 2: callbacks never run on the engine's threads
@pytest.mark.parametrize("inflight", [1, 2])
def test_close_from_a_done_callback(inflight: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler waits for an in-flight slot the completer gives back; the callback closing the engine must not
    run on the completer."""
    eng = Engine("tiny-dense", backend="breakable", max_inflight_batches=inflight, **SMALL)
    entered, go = hold_first_served_forward(eng, monkeypatch)
    first = eng.submit([1, 2, 3])
    assert entered.wait(HANG_S)
    closed, ran_on = threading.Event(), []

    def close(_: Any) -> None:
        ran_on.append(threading.current_thread().name)
        eng.close()
        closed.set()

    first.add_done_callback(close)
    later = [eng.submit(p) for p in random_prompts([5, 7, 9], seed=4)]
    go.set()
    assert closed.wait(HANG_S), "close() from a done-callback hung"
    assert ran_on == ["bcg-callbacks"]
    wait_for(lambda: stopped(eng), "the engine's threads to stop")
    assert same(first.result(timeout=1), [1, 2, 3])
    for f in later:  # each either ran before the close or was failed by it: none is left pending
        assert f.done() and (f.exception() is None or isinstance(f.exception(), EngineClosedError))
    assert eng.prefix_cache.num_cached_tokens == 0 and eng.kv_pool.num_free == eng.kv_pool.num_slots


@pytest.mark.parametrize("inflight", [1, 2])
def test_recapture_from_a_done_callback(inflight: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The completer's own forward, and one queued behind it, finish while a callback recaptures."""
    eng = Engine("tiny-dense", backend="breakable", max_inflight_batches=inflight, **SMALL)
    entered, go = hold_first_served_forward(eng, monkeypatch)
    first = eng.submit([1, 2, 3])
    assert entered.wait(HANG_S)
    records: list[Any] = []
    first.add_done_callback(lambda _: records.append(eng.recapture(16)))
    later = [eng.submit(p) for p in random_prompts([12, 14], seed=5)]
    go.set()
    wait_for(lambda: bool(records), "recapture() from a done-callback")
    assert records[0].disabled_reason is None
    for f, p in zip(later, random_prompts([12, 14], seed=5)):
        assert same(f.result(timeout=HANG_S), p)
    eng.close()


def test_a_callback_added_to_a_done_future_runs_in_the_callers_thread() -> None:
    eng = Engine("tiny-dense", backend="eager", **SMALL)
    with eng:
        fut = eng.submit([4, 5])
        fut.result(timeout=HANG_S)
        ran_on: list[str] = []
        fut.add_done_callback(lambda _: ran_on.append(threading.current_thread().name))
        assert ran_on == [threading.current_thread().name]


# ---------------------------------------------------------------- rule 3: every exit path leaves the gate balanced
def test_an_interrupt_out_of_a_served_forward_closes_the_whole_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine("tiny-dense", backend="breakable", **SMALL)

    def interrupt() -> None:
        raise KeyboardInterrupt

    entered, go = hold_first_served_forward(eng, monkeypatch, interrupt)
    fut = eng.submit([1, 2, 3])
    go.set()
    assert isinstance(fut.exception(timeout=HANG_S), KeyboardInterrupt)
    wait_for(lambda: stopped(eng), "the scheduler to stop")
    assert eng._gate.num_active == 0 and eng._gate.num_holders == 0
    for call in (lambda: eng.submit([1, 2]), lambda: eng.prefill([[1, 2]])):
        with pytest.raises(EngineClosedError, match=r"scheduler stopped \(KeyboardInterrupt\); build a new one") as e:
            call()
        assert str(e.value).count("KeyboardInterrupt") == 1
    recapture, out = in_thread(lambda: eng.recapture(16))
    finishes(recapture, "recapture after the interrupt")
    assert out["result"].disabled_reason is None
    eng.close()
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots


def test_an_interrupt_out_of_a_prefill_forward_leaves_the_gate_balanced(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine("tiny-dense", backend="breakable", **SMALL)
    real = eng.runner.forward

    def forward(batch: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(eng.runner, "forward", forward)
    with pytest.raises(KeyboardInterrupt):
        eng.prefill([[1, 2, 3], list(range(40))])
    monkeypatch.setattr(eng.runner, "forward", real)
    assert eng._gate.num_active == 0 and eng._gate.num_holders == 0
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
    recapture, _ = in_thread(lambda: eng.recapture(8))
    finishes(recapture, "recapture after an interrupted prefill")
    assert same(eng.prefill([[1, 2, 3]]), [1, 2, 3])


def test_an_interrupted_recapture_wait_lets_forwards_run() -> None:
    gate = ActivityGate()
    gate.enter()  # a forward in flight: the recapture waits for it

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    gate._cond.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), gate.quiet():
        pass
    assert gate.num_recaptures == 0
    gate.exit()
    forward, _ = in_thread(gate.enter)
    finishes(forward, "a forward after an interrupted recapture")


# ---------------------------------------------------------------- rule 4: a wait is for slots someone will give back
def test_a_hit_ending_inside_a_cached_node_locks_only_what_it_reads() -> None:
    """One cached 64-token prompt fills the pool; its first 5 tokens hit 4 of them and need 1 slot more, which the
    unread rest of the node gives up."""
    eng = Engine("tiny-dense", backend="breakable", **{**SMALL, "buckets": [8, 16, 32, 64],
                                                       "chunked_prefill_size": 64})
    with eng:
        prompt = random_prompts([64], seed=6)[0]
        assert same(eng.submit(prompt).result(timeout=HANG_S), prompt)
        assert eng.prefix_cache.num_cached_tokens == 64 and eng.kv_pool.num_free == 0
        res = eng.submit(prompt[:5]).result(timeout=HANG_S)
        assert res.cached_tokens == 4 and same(res, prompt[:5])


def test_a_prefix_inserted_by_a_running_request_is_never_evicted_before_it_is_locked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's allocation may evict right after a chunk's prefix is inserted (here: every time); the
    request's newest prefix must already be locked, or its next chunk adopts freed slots a second time."""
    eng = Engine("tiny-dense", backend="breakable", **SMALL)
    cache = eng.prefix_cache
    real = cache.insert

    def insert_then_evict(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        cache.clear()  # what a concurrent prefill's reservation may do at this moment
        return out

    monkeypatch.setattr(cache, "insert", insert_then_evict)
    with eng:
        prompt = random_prompts([60], seed=7)[0]  # four chunks of 16
        assert same(eng.submit(prompt).result(timeout=HANG_S), prompt)
        assert cache.num_cached_tokens + eng.kv_pool.num_free == eng.kv_pool.num_slots  # no slot owned twice


# ---------------------------------------------------------------- rule 5: nothing starts after close()
def test_close_racing_the_first_submit_starts_no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() runs (from another thread) after submit() checked the engine is open and before it starts the
    server: the submit must refuse, and nothing may be left running or cached."""
    eng = Engine("tiny-dense", backend="eager", **SMALL)
    real = engine_module.validate_prompts

    def validate_then_close(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        closer, _ = in_thread(eng.close)
        finishes(closer, "close")
        return out

    monkeypatch.setattr(engine_module, "validate_prompts", validate_then_close)
    with pytest.raises(EngineClosedError):
        eng.submit([1, 2, 3])
    assert eng._server is None and stopped(eng)
    assert eng.prefix_cache.num_cached_tokens == 0 and eng.kv_pool.num_free == eng.kv_pool.num_slots


# ---------------------------------------------------------------- cancellation
def test_asubmit_answers_and_a_cancelled_task_cancels_its_pending_request(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    eng = Engine("tiny-dense", backend="breakable", **SMALL)
    entered, go = hold_first_served_forward(eng, monkeypatch)

    async def main() -> Any:
        first = asyncio.ensure_future(eng.asubmit([1, 2, 3]))
        while not entered.is_set():
            await asyncio.sleep(0.001)
        victim = asyncio.ensure_future(eng.asubmit([7, 8, 9, 10, 11]))
        await asyncio.sleep(0.01)
        victim.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await victim
        return await asyncio.wait_for(first, HANG_S)

    with eng:
        assert same(asyncio.run(main()), [1, 2, 3])
        assert 5 not in [b.num_tokens for b in eng.telemetry.batches]  # the cancelled request never ran
