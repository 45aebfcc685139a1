"""One engine called from several threads: every answer must equal an eager engine's for the same prompt."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_cache import EngineCache, random_prompts

BUCKETS = [8, 16, 32, 64]
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, device="cpu",
                     per_backend={"tc_piecewise": {"tc_compiler": "traced"}, "full": {"max_requests": 4}})


def hammer(eng, ref, num_threads: int = 2, rounds: int = 6) -> list[str]:
    """Each thread prefills its own prompts ``rounds`` times; returns what went wrong (empty when all is well)."""
    work = [random_prompts([5 + 7 * t, 11 + 3 * t], seed=t) for t in range(num_threads)]
    expected = [ref.prefill(p) for p in work]
    barrier = threading.Barrier(num_threads, timeout=120)
    errors: list[str] = []

    def run(t: int) -> None:
        try:
            barrier.wait()
            for r in range(rounds):
                res = eng.prefill(work[t])
                diff = (res.logits - expected[t].logits).abs().max().item()
                if diff > 1e-4 or not torch.equal(res.next_tokens, expected[t].next_tokens):
                    errors.append(f"thread {t} round {r}: max |diff| {diff:.3g}")
                if not all(b.graph_used for b in res.batches):
                    errors.append(f"thread {t} round {r}: ran eagerly ({[b.reason for b in res.batches]})")
        except BaseException as e:  # surfaced in the main thread
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a prefill thread hung"
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
    return errors


@pytest.mark.parametrize("backend", ["breakable", "full", "tc_piecewise"])
def test_two_threads_on_one_engine_match_eager(backend: str) -> None:
    eng = engine("tiny-dense", backend)
    assert eng.telemetry.num_captured == len(BUCKETS)
    assert hammer(eng, engine("tiny-dense", "eager")) == []


def test_eager_engine_serves_two_threads() -> None:
    eng = engine("tiny-moe", "eager")
    work = [random_prompts([9, 4], seed=1), random_prompts([17], seed=2)]
    expected = [eng.prefill(p).logits for p in work]
    out: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors: list[str] = []

    def run(t: int) -> None:
        try:
            for _ in range(5):
                out[t].append(eng.prefill(work[t]).logits)
        except BaseException as e:  # surfaced in the main thread (an empty list would pass the check below)
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(t,)) for t in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert errors == [] and [len(out[0]), len(out[1])] == [5, 5]
    assert all(torch.equal(x, expected[t]) for t in (0, 1) for x in out[t])
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
