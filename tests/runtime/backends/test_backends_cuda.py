"""The CUDA tier of the graph backends (breakable, full, tc_piecewise): real CUDA graphs, bf16, varlen, Inductor."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_cache import EngineCache, random_prompts

from bcg.models import get_preset

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = [16, 32, 64]
# Tiny presets with GPU-friendly attention and expert shapes (head_dim 64, dims multiples of 16).
CONFIGS = {
    name: replace(get_preset(name), hidden_size=256, head_dim=64, intermediate_size=512, moe_intermediate_size=64)
    for name in ("tiny-dense", "tiny-moe", "tiny-dsa")
}
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16", device="cuda",
                     per_backend={"full": {"max_requests": 6, "prefix_capacity": 192}}, model_for=CONFIGS.get)
prompts = random_prompts


def assert_matches(res, ref, rel: float = 2e-2) -> None:
    """Logits within bf16 tolerance; the same greedy token wherever eager's top-2 margin clears that tolerance."""
    tol = rel * max(1.0, ref.logits.abs().max().item())
    assert (res.logits - ref.logits).abs().max().item() <= tol
    top2 = ref.logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(res.next_tokens[clear], ref.next_tokens[clear])


COMPOSITIONS = [[3, 7, 12, 1], [40, 9], [5, 4, 3, 2, 1, 6], [64], [150]]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_breakable_matches_eager_in_bf16(preset: str) -> None:
    for lengths in COMPOSITIONS:  # [150] is chunked over three forwards, the later ones with a cached prefix
        res = engine(preset, "breakable").prefill(prompts(lengths))
        assert_matches(res, engine(preset, "eager").prefill(prompts(lengths)))
        assert any(b.graph_used for b in res.batches)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_breakable_replay_is_identical_to_eager_at_the_padded_shape(preset: str) -> None:
    from bcg.runtime.batch import PrefillBatch, PrefillItem

    eng = engine(preset, "breakable")
    slots = eng.kv_pool.alloc(21)
    try:
        ids = prompts([9, 12])
        batch = PrefillBatch([PrefillItem(torch.tensor(ids[0]), slots[:9]),
                              PrefillItem(torch.tensor(ids[1]), slots[9:])], eng.kv_pool)
        with torch.inference_mode(), eng.runner.replay_context(batch) as (bucket, handle):
            handle.replay()
            graph_out = eng.runner.static_output[:bucket].clone()
            eng.runner.run_step_eagerly(bucket)  # the same fields, eagerly
            eager_out = eng.runner.static_output[:bucket].clone()
    finally:
        eng.kv_pool.free(slots)
    assert bucket == 32 and torch.equal(graph_out[:21], eager_out[:21])


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("backend", ["full", "tc_piecewise"])
def test_matches_eager_in_bf16(preset: str, backend: str) -> None:
    eng, ref = engine(preset, backend), engine(preset, "eager")
    assert eng.telemetry.refused_reason is None and eng.telemetry.num_captured == len(BUCKETS)
    assert eng.telemetry.graph_memory_bytes > 0
    for lengths in COMPOSITIONS:
        res = eng.prefill(prompts(lengths))
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 8), res.batches
        assert_matches(res, ref.prefill(prompts(lengths)))


def test_full_uses_varlen_with_static_metadata_and_sentinels() -> None:
    from bcg.ops.flash import varlen_attn, varlen_causal_is_bottom_right

    eng, ref = engine("tiny-dense", "full"), engine("tiny-dense", "eager")
    expected = varlen_attn is not None and varlen_causal_is_bottom_right(torch.device("cuda", 0))
    assert eng.runner.inputs.attention.use_varlen == expected
    for lengths in ([3, 4, 2, 5, 1], [6, 5], [3, 4, 2, 5, 1], [6, 5]):  # sentinels must not leak
        res = eng.prefill(prompts(lengths, seed=len(lengths)))
        assert res.batches[0].graph_used
        assert_matches(res, ref.prefill(prompts(lengths, seed=len(lengths))))
    res = eng.prefill(prompts([2] * 7))
    assert res.batches[0].reason == "too_many_requests"


def test_full_fp32_uses_the_masked_path() -> None:
    eng, ref = engine("tiny-moe", "full", dtype="float32"), engine("tiny-moe", "eager", dtype="float32")
    assert not eng.runner.inputs.attention.use_varlen
    for lengths in COMPOSITIONS:
        res, expected = eng.prefill(prompts(lengths)), ref.prefill(prompts(lengths))
        assert (res.logits - expected.logits).abs().max().item() <= 1e-4
        assert torch.equal(res.next_tokens, expected.next_tokens)


def test_tc_piecewise_traces_once_and_replays_every_bucket() -> None:
    eng = engine("tiny-moe", "tc_piecewise")
    backend, layers = eng.runner.backend, CONFIGS["tiny-moe"].num_layers
    for lengths in COMPOSITIONS:
        eng.prefill(prompts(lengths))
    assert backend.compiler.num_compiles == 1
    assert all(sorted(p.graphs) == BUCKETS for p in backend.compiler.pieces)
    assert (eng.telemetry.buckets[64].num_segments, eng.telemetry.buckets[64].num_breaks) == (layers + 1, layers)
    assert eng.telemetry.compile_ms > 0 and eng.telemetry.capture_ms > 0


def test_tc_piecewise_without_inductor_matches_eager() -> None:
    eng, ref = engine("tiny-dense", "tc_piecewise", tc_compiler="traced"), engine("tiny-dense", "eager")
    for lengths in COMPOSITIONS:
        assert_matches(eng.prefill(prompts(lengths)), ref.prefill(prompts(lengths)))


@pytest.mark.parametrize("backend", ["full", "tc_piecewise"])
def test_dsa_is_refused_and_served_eagerly(backend: str) -> None:
    eng = engine("tiny-dsa", backend)
    reason = eng.telemetry.refused_reason
    assert reason is not None and "select_topk" in reason and "breakable" in reason
    batch = prompts([3, 7, 12, 1])
    res, ref = eng.prefill(batch), engine("tiny-dsa", "eager").prefill(batch)
    assert [b.reason for b in res.batches] == ["backend_refused"]
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_breakable_verify_finds_every_bucket_identical_to_eager(preset: str) -> None:
    from bcg.runtime.runner.verify import verify_buckets

    diffs = verify_buckets(engine(preset, "breakable").runner)
    assert set(diffs) == set(BUCKETS) and all(d == 0.0 for d in diffs.values())


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_a_breakable_prefill_never_waits_for_the_gpu(preset: str) -> None:
    """No host synchronisation from the call to the result: not in the islands (DSA's included), not around the
    replay; the host keeps launching ahead of the device until the caller reads the result."""
    eng, ref = engine(preset, "breakable"), engine(preset, "eager")
    compositions = [prompts([5, 17, 3]), prompts([150]), prompts([64])]  # [150]: chunks with a cached prefix
    for batch in compositions:  # every lazy, once-per-device probe has run
        eng.prefill(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [eng.prefill(batch) for batch in compositions]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for batch, res in zip(compositions, results):
        assert all(b.graph_used for b in res.batches), res.batches
        assert_matches(res, ref.prefill(batch))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_breakable_with_whole_step_graphs_matches_eager_in_bf16(preset: str) -> None:
    """full_graph_tokens on CUDA: the small buckets' whole-step graphs attend with bcg's Triton kernel from the pool;
    batches that fit replay them, the rest the breakable graphs, every answer eager's."""
    from bcg.runtime import Engine

    eng = Engine(CONFIGS[preset], buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16",
                 device="cuda", max_requests=4, full_graph_tokens=32, verify=True, progress=False)
    assert eng.runner.full.telemetry.attention_backend == "static_triton"
    assert sorted(eng.runner.full.handles) == [16, 32]
    ref = engine(preset, "eager")
    reasons = set()
    for lengths in ([5], [3, 7, 12, 1], [2] * 6, [40, 9], [150]):
        res = eng.prefill(prompts(lengths))
        reasons |= {b.reason for b in res.batches}
        assert_matches(res, ref.prefill(prompts(lengths)))
    assert "graph_full" in reasons and "graph" in reasons


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_a_default_breakable_engine_holds_whole_step_graphs_on_one_gpu(preset: str) -> None:
    """No full_graph_tokens given: every bucket holds a whole-step graph (up to 2048 tokens; a DSA model's are
    refused with a note, its breakable graphs serve), and every answer is eager's."""
    from bcg.runtime import Engine

    eng = Engine(CONFIGS[preset], buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16",
                 device="cuda", max_requests=4, progress=False)  # request slots: 1 by default at a 64-token chunk
    assert eng.config.full_graph_tokens == max(eng.config.buckets) == 64
    is_refused = preset == "tiny-dsa"
    assert (eng.runner.full.table.refused_reason is not None) == is_refused
    assert any(n.startswith("full graphs:") and ("refused" in n) == is_refused for n in eng.telemetry.notes)
    ref = engine(preset, "eager")
    for lengths in ([5], [3, 7, 12, 1], [40, 9]):
        res = eng.prefill(prompts(lengths))
        assert all(b.graph_used and (b.reason == "graph_full") != is_refused for b in res.batches), res.batches
        assert_matches(res, ref.prefill(prompts(lengths)))
