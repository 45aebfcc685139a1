"""Engine.submit on the CPU (graphs emulated): futures from many threads equal to eager prefills, prefix hits that
replay graphs, answers equal with and without the cache, eviction under KV pressure, a failing forward failing
only its own requests, cancellation, close with pending requests, and the gate shared with prefill()."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from engine_cache import EngineCache, max_diff, random_prompts

from bcg.runtime import Engine, EngineClosedError, EngineConfig

BUCKETS = [8, 16, 32, 64]
COMMON = dict(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, device="cpu")
engine = EngineCache(**COMMON, per_backend={"tc_piecewise": {"tc_compiler": "traced"},
                                            "full": {"max_requests": 8, "prefix_capacity": 192}})
TOL = 1e-5  # fp32 on the CPU


def reference(prompts: list[list[int]], preset: str = "tiny-dense") -> list:
    """Sequential eager prefills, one prompt each."""
    ref = engine(preset, "eager", prefix_cache=False)
    return [ref.prefill([p]) for p in prompts]


def same(res, ref) -> bool:
    return max_diff(res.logits, ref.logits) <= TOL and torch.equal(res.next_tokens, ref.next_tokens)


def shared(num: int, head: int, tails: tuple[int, int] = (1, 40), seed: int = 0) -> list[list[int]]:
    """``num`` prompts opening with the same ``head`` tokens, then their own ``tails`` tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (head,), generator=g).tolist()
    lengths = torch.randint(tails[0], tails[1], (num,), generator=g).tolist()
    return [prefix + t for t in random_prompts(lengths, seed=seed + 1)]


def wait_for(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def whole(eng: Engine) -> bool:
    """No slot leaked: once the cache is cleared every slot is free again."""
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()
    return eng.kv_pool.num_free == eng.kv_pool.num_slots


# ---------------------------------------------------------------- answers
def test_futures_from_eight_threads_equal_sequential_eager_prefills() -> None:
    eng = engine("tiny-dense", "breakable")
    work = [shared(6, head=8 * (t % 3), seed=t) for t in range(8)]
    results: dict[int, list] = {}
    barrier = threading.Barrier(8, timeout=60)

    def client(t: int) -> None:
        barrier.wait()
        results[t] = [eng.submit(p) for p in work[t]]

    threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for t in range(8):
        for fut, ref in zip(results[t], reference(work[t])):
            res = fut.result(timeout=120)
            assert same(res, ref) and res.logits.shape == (1, 256) and res.next_tokens.shape == (1,)
            assert 0 <= res.queue_ms <= res.ttft_ms and res.batches
    assert all(b.num_tokens <= 64 for b in eng.telemetry.batches)  # the budget
    assert whole(eng)


@pytest.mark.parametrize("backend", ["breakable", "full", "tc_piecewise"])
def test_prefix_hits_replay_graphs_and_answer_as_eager(backend: str) -> None:
    eng = engine("tiny-dense", backend)
    eng.prefix_cache.clear()
    prompts = shared(4, head=30, tails=(2, 20), seed=11)
    first = eng.submit(prompts[0]).result(timeout=60)
    assert first.cached_tokens == 0
    rest = [eng.submit(p).result(timeout=60) for p in prompts[1:]]
    for res, ref in zip([first, *rest], reference(prompts)):
        assert same(res, ref)
    for res in rest:
        assert res.cached_tokens == 30 and res.num_tokens > 30
        assert all(b.graph_used for b in res.batches), [b.reason for b in res.batches]


def test_answers_equal_with_and_without_the_cache_chunked_prompts_included() -> None:
    on, off = engine("tiny-dense", "breakable"), engine("tiny-dense", "breakable", prefix_cache=False)
    assert off.prefix_cache is None
    on.prefix_cache.clear()
    # A 100-token head: longer than a chunk (64), so both the prompt that caches it and those reading it are chunked.
    prompts = shared(5, head=100, tails=(1, 90), seed=5)
    with_cache = [on.submit(p).result(timeout=60) for p in prompts]
    without = [off.submit(p).result(timeout=60) for p in prompts]
    for a, b, ref in zip(with_cache, without, reference(prompts)):
        assert max_diff(a.logits, b.logits) <= TOL and torch.equal(a.next_tokens, b.next_tokens) and same(a, ref)
        assert b.cached_tokens == 0
    assert [r.cached_tokens for r in with_cache[1:]] == [100] * 4
    assert any(len(r.batches) > 1 for r in with_cache[1:])  # chunked while reading the cached prefix


def test_a_fully_cached_prompt_reruns_its_last_token() -> None:
    eng = engine("tiny-dense", "breakable")
    prompt = random_prompts([37], seed=21)[0]
    first = eng.submit(prompt).result(timeout=60)
    again = eng.submit(prompt).result(timeout=60)
    assert again.cached_tokens == 36 and [b.num_tokens for b in again.batches] == [1]
    assert max_diff(first.logits, again.logits) <= TOL and same(again, reference([prompt])[0])


def test_requests_that_share_a_prefix_while_it_is_being_computed() -> None:
    """The chunks of a long prompt are cached as they run, so a request arriving meanwhile reads them."""
    eng = engine("tiny-dense", "breakable")
    eng.prefix_cache.clear()
    prompts = shared(2, head=180, tails=(5, 6), seed=8)
    futures = [eng.submit(prompts[0])]
    wait_for(lambda: eng.prefix_cache.num_cached_tokens >= 64)  # its first chunk ran
    futures.append(eng.submit(prompts[1]))
    results = [f.result(timeout=60) for f in futures]
    assert results[1].cached_tokens >= 64
    assert all(same(r, ref) for r, ref in zip(results, reference(prompts)))


def test_shortest_first_policy_answers_alike() -> None:
    eng = engine("tiny-dense", "breakable", schedule_policy="shortest")
    prompts = shared(10, head=12, tails=(1, 120), seed=3)
    futures = [eng.submit(p) for p in prompts]
    assert all(same(f.result(timeout=60), ref) for f, ref in zip(futures, reference(prompts)))


def test_asubmit() -> None:
    eng = engine("tiny-dense", "breakable")
    prompts = shared(4, head=10, seed=4)

    async def main() -> list:
        return await asyncio.gather(*(eng.asubmit(p) for p in prompts))

    assert all(same(r, ref) for r, ref in zip(asyncio.run(main()), reference(prompts)))


def test_moe_and_dsa_models_serve_from_the_cache() -> None:
    for preset in ("tiny-moe", "tiny-dsa"):
        eng = engine(preset, "breakable")
        prompts = shared(3, head=24, tails=(3, 30), seed=6)
        results = [eng.submit(p).result(timeout=60) for p in prompts]
        assert [r.cached_tokens for r in results[1:]] == [24, 24]
        for res, ref in zip(results, reference(prompts, preset)):
            assert max_diff(res.logits, ref.logits) <= 1e-4 and torch.equal(res.next_tokens, ref.next_tokens)


# ---------------------------------------------------------------- KV pressure
def test_eviction_under_kv_pressure_never_breaks_a_running_request() -> None:
    eng = engine("tiny-dense", "breakable", kv_tokens=256)
    eng.prefix_cache.clear()
    evicted = eng.prefix_cache.num_evicted_tokens
    long = shared(1, head=200, tails=(10, 11), seed=9)  # four chunks, reading its own cached chunks
    others = [shared(1, head=0, tails=(30, 60), seed=100 + i)[0] for i in range(24)]  # fill the cache
    prompts = long + others[:12] + long + others[12:]
    futures = [eng.submit(p) for p in prompts]
    results = [f.result(timeout=120) for f in futures]
    assert all(same(r, ref) for r, ref in zip(results, reference(prompts)))
    assert eng.prefix_cache.num_evicted_tokens > evicted
    assert whole(eng)


def test_a_prompt_larger_than_the_pool_is_refused_at_submit() -> None:
    eng = engine("tiny-dense", "breakable", kv_tokens=128)
    ok, big = random_prompts([20], seed=1)[0], random_prompts([300], seed=2)[0]
    with pytest.raises(ValueError, match="needs 300 KV slots but the pool holds 128; raise kv_tokens"):
        eng.submit(big)
    assert same(eng.submit(ok).result(timeout=60), reference([ok])[0])
    assert eng.submit(ok).result(timeout=60).cached_tokens  # the engine serves on as before
    assert whole(eng)


def test_prefill_waits_for_slots_the_server_holds() -> None:
    """With a pool too small for both, a prefill() waits for the served requests' slots instead of failing."""
    eng = engine("tiny-dense", "breakable", kv_tokens=192)
    served = shared(12, head=0, tails=(40, 60), seed=30)
    batch = random_prompts([150], seed=31)
    futures = [eng.submit(p) for p in served]
    res = eng.prefill(batch)
    assert same(res, reference(batch)[0])
    assert all(same(f.result(timeout=60), ref) for f, ref in zip(futures, reference(served)))
    assert whole(eng)


# ---------------------------------------------------------------- failures, cancellation, close
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


def test_an_engine_used_only_for_prefill_starts_no_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    with Engine("tiny-dense", backend="eager", device="cpu", progress=False, kv_tokens=64) as eng:
        eng.prefill([[1, 2, 3]])
        assert eng._server is None
    assert {t.name for t in threading.enumerate()} <= before | {"MainThread"}


def test_submit_refuses_bad_prompts_at_once_and_the_config_refuses_bad_options() -> None:
    eng = engine("tiny-dense", "breakable")
    with pytest.raises(TypeError, match="tokenize it first"):
        eng.submit("hello")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1, 999])
    with pytest.raises(ValueError, match="needs tp_size=1"):
        EngineConfig(prefix_cache=True, tp_size=2)
    assert not EngineConfig(tp_size=2).uses_prefix_cache and EngineConfig().uses_prefix_cache
    with pytest.raises(TypeError, match="prefix_cache must be True or False"):
        EngineConfig(prefix_cache="yes")
    with pytest.raises(ValueError, match="schedule_policy must be one of fifo, shortest"):
        EngineConfig(schedule_policy="lifo")
    with pytest.raises(ValueError, match="max_inflight_batches must be >= 1"):
        EngineConfig(max_inflight_batches=0)


def test_a_prompt_tensor_changed_after_submit_does_not_change_the_request() -> None:
    eng = engine("tiny-dense", "breakable")
    prompt = random_prompts([30], seed=40)[0]
    as_tensor, as_array = torch.tensor(prompt), np.array(prompt, dtype=np.int64)
    futures = [eng.submit(as_tensor), eng.submit(as_array)]
    as_tensor.fill_(0)  # the caller reuses its buffers at once
    as_array.fill(0)
    ref = reference([prompt])[0]
    assert all(same(f.result(timeout=60), ref) for f in futures)


def test_recapture_while_serving() -> None:
    eng = engine("tiny-dense", "breakable")
    prompts = shared(30, head=16, seed=15)
    futures = [eng.submit(p) for p in prompts[:15]]
    record = eng.recapture(32)
    futures += [eng.submit(p) for p in prompts[15:]]
    assert record.disabled_reason is None
    assert all(same(f.result(timeout=60), ref) for f, ref in zip(futures, reference(prompts)))


class SlowDevice:
    """A stand-in device event per forward that completes only when the test says so."""

    def __init__(self) -> None:
        self.events: list[threading.Event] = []
        self.lock = threading.Lock()

    def record(self) -> Any:
        done = threading.Event()
        with self.lock:
            self.events.append(done)

        class Event:
            def synchronize(self) -> None:
                assert done.wait(20)

        return Event()


@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_the_next_forward_is_launched_while_the_device_runs_the_last(inflight: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With a device that has not finished, the scheduler launches up to max_inflight_batches forwards and then
    waits; each future resolves only once its forward's event completed."""
    eng = Engine("tiny-dense", backend="breakable", seed=0, progress=False, max_inflight_batches=inflight, **COMMON)
    device = SlowDevice()
    with eng:
        futures = [eng.submit([1, 2, 3])]
        futures[0].result(timeout=60)  # before the stand-in: completes as on a CPU
        monkeypatch.setattr(eng._server, "_record_event", device.record)
        # One request per forward: each arrives after the previous forward was launched.
        for i in range(inflight + 2):
            futures.append(eng.submit([5, 6, 7 + i]))
            if i < inflight:
                wait_for(lambda n=i: len(device.events) == n + 1)
        time.sleep(0.05)
        assert len(device.events) == inflight  # no forward beyond max_inflight_batches ahead of the device
        assert not any(f.done() for f in futures[1:])  # launched, not complete: nobody's result yet
        device.events[0].set()
        assert futures[1].result(timeout=60).logits.shape == (1, 256)
        wait_for(lambda: len(device.events) == inflight + 1)  # a slot freed: the next forward launched at once
        for e in list(device.events):
            e.set()
        while not all(f.done() for f in futures):
            for e in list(device.events):
                e.set()
            time.sleep(0.002)
        assert all(f.exception() is None for f in futures)


def test_an_engine_dropped_without_close_stops_its_threads() -> None:
    import gc
    import weakref

    def new_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("bcg-")} - before

    before: set = set()
    before = new_threads()
    eng = Engine("tiny-dense", backend="breakable", seed=0, progress=False, **COMMON)
    assert eng.submit([1, 2, 3]).result(timeout=60).cached_tokens == 0
    assert {t.name for t in new_threads()} == {"bcg-scheduler", "bcg-completer", "bcg-callbacks"}
    pool = weakref.ref(eng.kv_pool)
    del eng
    gc.collect()
    wait_for(lambda: not new_threads())
    assert pool() is None  # nothing of the engine is kept alive by its threads
