"""The CUDA tier of an engine's life as a server: threads, KV slots on every exit path, replay failures and
recapture, a 32k-token prompt, the segment check and the leak detector on real graphs."""

from __future__ import annotations

import gc
import threading
from dataclasses import replace

import pytest
import torch
from engine_cache import EngineCache, random_prompts
from stand_ins import wrong_output

from bcg.graph import EagerStep
from bcg.models import get_preset

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = [16, 32, 64]
CONFIGS = {name: replace(get_preset(name), hidden_size=256, head_dim=64, intermediate_size=512,
                         moe_intermediate_size=64) for name in ("tiny-dense", "tiny-moe", "tiny-dsa")}
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16", device="cuda",
                     per_backend={"full": {"max_requests": 6, "prefix_capacity": 192},
                                  "tc_piecewise": {"tc_compiler": "traced"}}, model_for=CONFIGS.get)


def close(res, ref, rel: float = 2e-2) -> bool:
    tol = rel * max(1.0, ref.logits.abs().max().item())
    return (res.logits - ref.logits).abs().max().item() <= tol


@pytest.mark.parametrize("backend", ["breakable", "full", "tc_piecewise"])
def test_two_threads_on_one_engine_reproduce_its_answers(backend: str) -> None:
    eng, ref = engine("tiny-dense", backend), engine("tiny-dense", "eager")
    work = [random_prompts([5 + 9 * t, 20 - 3 * t, 70], seed=t) for t in range(2)]  # 70: chunked, with a prefix
    expected = [eng.prefill(p) for p in work]
    assert all(close(e, ref.prefill(p)) for e, p in zip(expected, work))
    barrier, errors = threading.Barrier(2, timeout=120), []

    def run(t: int) -> None:
        try:
            barrier.wait()
            for r in range(20):
                res = eng.prefill(work[t])
                if not torch.equal(res.logits, expected[t].logits):
                    errors.append(f"thread {t} round {r}: {(res.logits - expected[t].logits).abs().max().item()}")
        except BaseException as e:  # surfaced below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert errors == [] and eng.kv_pool.num_free == eng.kv_pool.num_slots


def test_transient_replay_failures_retry_and_a_bucket_recaptures_while_serving() -> None:
    from bcg.runtime import Engine

    eng = Engine(CONFIGS["tiny-dense"], backend="breakable", device="cuda", dtype="bfloat16", buckets=BUCKETS,
                 chunked_prefill_size=64, kv_tokens=1024, progress=False, max_replay_failures=2,
                 full_graph_tokens=0)  # the islands fail here, so every batch goes through them
    ref = engine("tiny-dense", "eager")
    step = next(s for s in eng.runner.handles[32].steps if isinstance(s, EagerStep))
    real, fails = step.fn, {"left": 1}

    def flaky(*args, **kwargs):
        if fails["left"] > 0:
            fails["left"] -= 1
            raise RuntimeError("transient island failure (injected)")
        return real(*args, **kwargs)

    step.fn = flaky
    prompt = random_prompts([25])
    assert eng.prefill(prompt).batches[0].reason == "replay_failed"
    res = eng.prefill(prompt)
    assert res.batches[0].graph_used and res.batches[0].bucket == 32 and close(res, ref.prefill(prompt))
    fails["left"] = 2
    assert [eng.prefill(prompt).batches[0].reason for _ in range(2)] == ["replay_failed"] * 2
    assert eng.telemetry.buckets[32].disabled_reason is not None
    moved = eng.prefill(prompt).batches[0]
    assert moved.graph_used and moved.bucket == 64
    record = eng.recapture(32)  # a real CUDA capture after the engine served batches
    assert record.disabled_reason is None and record.capture_ms > 0
    res = eng.prefill(prompt)
    assert res.batches[0].bucket == 32 and close(res, ref.prefill(prompt))
    from bcg.runtime.runner.verify import verify_buckets

    assert verify_buckets(eng.runner)[32] == 0.0


def test_a_32k_token_prompt_on_llama_dense_breakable_matches_eager() -> None:
    from bcg.runtime import Engine

    prompt = random_prompts([32768], seed=32, vocab=32000)
    graph = Engine("llama-dense", backend="breakable", device="cuda", progress=False)  # every default
    assert graph.kv_pool.num_slots >= 32768
    res = graph.prefill(prompt)
    assert len(res.batches) == 16 and all(b.graph_used for b in res.batches)
    del graph
    gc.collect()
    torch.cuda.empty_cache()
    eager = Engine("llama-dense", backend="eager", device="cuda", kv_tokens=40000, progress=False)
    ref = eager.prefill(prompt)
    assert torch.equal(res.next_tokens, ref.next_tokens)
    assert (res.logits - ref.logits).abs().max().item() <= 2e-2 * max(1.0, ref.logits.abs().max().item())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eager.prefill(random_prompts([32769], vocab=32000))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_segment_check_finds_real_graphs_identical_to_eager(preset: str) -> None:
    from bcg.runtime.runner.verify import verify_segments

    report = verify_segments(engine(preset, "breakable").runner, 40)
    assert report.ok and report.bucket == 64 and report.max_diff == 0.0, str(report)


def test_segment_check_names_a_wrong_island_on_real_graphs() -> None:
    from bcg.runtime.runner.verify import verify_segments

    eng = engine("tiny-dense", "breakable")
    step = [s for s in eng.runner.handles[64].steps if isinstance(s, EagerStep)][1]
    real = step.fn
    step.fn = wrong_output(real, rows=4, factor=1.5)  # the same stand-in as the CPU twin (tests/runtime/runner)
    try:
        report = verify_segments(eng.runner, 40)
    finally:
        step.fn = real
    bad = report.first_divergence
    assert (bad.kind, bad.index) == ("island", 1) and report.island_before == f"{step.name}#1", str(report)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_the_models_islands_leak_nothing_on_cuda(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.runtime import Engine

    monkeypatch.setenv("BCG_LEAK_CHECK", "raise")
    eng = Engine(CONFIGS[preset], backend="breakable", device="cuda", dtype="bfloat16", buckets=[16, 32],
                 kv_tokens=256, progress=False, full_graph_tokens=0)  # every batch through the islands
    assert eng.telemetry.num_captured == 2, eng.telemetry.buckets
