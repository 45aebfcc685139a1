"""Engine.submit on the CPU (graphs emulated): futures from many threads equal to eager prefills, prefix hits that
replay graphs, answers equal with and without the cache, eviction under KV pressure, the gate shared with prefill(),
a recapture while serving.

Failures, cancellation and close, the engine's threads, and what submit refuses have their own files
(test_submit_failures, test_submit_threads, test_submit_refusals)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from engine_cache import max_diff, random_prompts
from submit_helpers import TOL, engine, reference, same, shared, whole
from threads import wait_for


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
