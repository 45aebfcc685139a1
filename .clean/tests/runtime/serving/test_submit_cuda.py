"""The CUDA tier of Engine.submit: bf16 greedy tokens with and without the prefix cache (tie-aware) on every graph
backend, a scheduler path that never synchronises, threads and eviction on real graphs, and the serving soak's quick
mode on the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_cache import EngineCache, random_prompts

from bcg.models import get_preset

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[3]
BUCKETS = [16, 32, 64]
CONFIGS = {name: replace(get_preset(name), hidden_size=256, head_dim=64, intermediate_size=512,
                         moe_intermediate_size=64) for name in ("tiny-dense", "tiny-moe", "tiny-dsa")}
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=2048, dtype="bfloat16", device="cuda",
                     per_backend={"full": {"max_requests": 8, "prefix_capacity": 256},
                                  "tc_piecewise": {"tc_compiler": "traced"}}, model_for=CONFIGS.get)
REL = 2e-2  # bf16


def shared(num: int, head: int, seed: int, tails: tuple[int, int] = (1, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (head,), generator=g).tolist()
    lengths = torch.randint(tails[0], tails[1], (num,), generator=g).tolist()
    return [prefix + t for t in random_prompts(lengths, seed=seed + 1)]


def assert_same_answer(res, ref) -> None:
    """Logits within bf16 rounding of eager's, and the same greedy token wherever eager's top-2 gap is clear."""
    tol = REL * max(1.0, ref.logits.abs().max().item())
    assert (res.logits - ref.logits).abs().max().item() <= tol
    top2 = ref.logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(res.next_tokens[clear], ref.next_tokens[clear])


def reference(preset: str, prompts: list[list[int]]) -> list:
    ref = engine(preset, "eager", prefix_cache=False)
    return [ref.prefill([p]) for p in prompts]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
@pytest.mark.parametrize("backend", ["breakable", "full", "tc_piecewise"])
def test_greedy_tokens_with_and_without_the_cache(preset: str, backend: str) -> None:
    if preset == "tiny-dsa" and backend != "breakable":
        pytest.skip("only breakable captures the sparse-indexer model (the others serve it eagerly)")
    on, off = engine(preset, backend), engine(preset, backend, prefix_cache=False)
    on.prefix_cache.clear()
    prompts = shared(8, head=100, seed=1, tails=(1, 80))  # the head is longer than a chunk: chunks read the cache
    with_cache = [on.submit(p).result(timeout=120) for p in prompts]
    without = [off.submit(p).result(timeout=120) for p in prompts]
    assert [r.cached_tokens for r in with_cache[1:]] == [100] * 7
    for a, b, ref in zip(with_cache, without, reference(preset, prompts)):
        assert_same_answer(a, ref)
        assert_same_answer(b, ref)
        assert a.logits.device.type == "cuda" and a.logits.shape == (1, 256)
    if backend == "breakable":
        assert all(b.graph_used for r in with_cache for b in r.batches)


def test_the_scheduler_path_never_synchronises() -> None:
    """Under sync debug mode "error" any host synchronisation on the scheduler's path raises there and fails its
    requests; the completer's event wait is the only wait, and it is not one the mode counts."""
    eng = engine("tiny-dense", "breakable")
    prompts = shared(40, head=48, seed=2, tails=(1, 120))
    for f in [eng.submit(p) for p in prompts[:8]]:  # every lazy, once-per-device probe has run
        f.result(timeout=120)
    eng.prefix_cache.clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        futures = [eng.submit(p) for p in prompts]
        errors = [f.exception(timeout=120) for f in futures]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert errors == [None] * len(prompts), next(e for e in errors if e is not None)
    for f, ref in zip(futures, reference("tiny-dense", prompts)):
        res = f.result()
        assert all(b.graph_used for b in res.batches)
        assert_same_answer(res, ref)


def test_eight_threads_and_eviction_on_real_graphs() -> None:
    eng = engine("tiny-dense", "breakable", kv_tokens=512)
    work = [shared(12, head=16 * (t % 4), seed=10 + t, tails=(8, 100)) for t in range(8)]
    results: dict[int, list] = {}

    def client(t: int) -> None:
        results[t] = [eng.submit(p) for p in work[t]]

    threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for t in range(8):
        for f, ref in zip(results[t], reference("tiny-dense", work[t])):
            assert_same_answer(f.result(timeout=120), ref)
    assert eng.prefix_cache.num_evicted_tokens > 0
    eng.prefix_cache.clear()
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots


def test_serve_soak_quick_on_the_gpu() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_soak.py"), "--quick", "--device", "cuda",
                           "--dtype", "bfloat16"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"]


@pytest.mark.parametrize("inflight", [1, 2])
def test_close_and_recapture_from_done_callbacks_on_real_events(inflight: int) -> None:
    """The gate's rules on the device: done-callbacks recapture and close while forwards are in flight behind real
    CUDA events, a prefill waits for slots meanwhile; nothing hangs and every answer is eager's."""
    from bcg.runtime import Engine

    eng = Engine(CONFIGS["tiny-dense"], backend="breakable", buckets=BUCKETS, chunked_prefill_size=64,
                 kv_tokens=256, dtype="bfloat16", device="cuda", seed=0, progress=False,
                 max_inflight_batches=inflight)
    prompts = shared(16, head=24, seed=60)
    records: list = []
    closed = threading.Event()
    futures = [eng.submit(p) for p in prompts[:8]]
    futures[0].add_done_callback(lambda _: records.append(eng.recapture(32)))
    prefilled = eng.prefill(prompts[8:10])
    futures += [eng.submit(p) for p in prompts[10:]]
    futures[-1].add_done_callback(lambda _: (eng.close(), closed.set()))
    assert closed.wait(120), "close() from a done-callback hung"
    for _ in range(3000):  # the recapture's callback may run after the close's
        if records:
            break
        closed.wait(0.01)
    assert records and records[0].disabled_reason is None
    refs = reference("tiny-dense", prompts)
    for f, ref in zip(futures, refs[:8] + refs[10:]):
        assert_same_answer(f.result(timeout=1), ref)
    for i, ref in enumerate(refs[8:10]):
        assert_same_answer(type(ref)(prefilled.logits[i : i + 1], prefilled.next_tokens[i : i + 1], []), ref)
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
