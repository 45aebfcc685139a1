"""Two graphs per small bucket (``full_graph_tokens``): a batch that fits the whole-step graph's request slots and key
capacity replays it (no island), any other the breakable graph of its bucket, and either answers as eager does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_cache import random_prompts

from bcg.runtime import Engine, EngineConfig
from bcg.runtime.backends.full import FullBackend
from bcg.runtime.config import DEFAULT_FULL_GRAPH_TOKENS

OPTS = dict(device="cpu", buckets=[8, 16, 32, 64], chunked_prefill_size=64, kv_tokens=512, max_requests=2,
            progress=False)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request: pytest.FixtureRequest) -> tuple[Engine, Engine]:
    dtype = request.param
    return (Engine("tiny-dense", dtype=dtype, full_graph_tokens=16, verify=True, **OPTS),
            Engine("tiny-dense", backend="eager", dtype=dtype, **OPTS))


@pytest.mark.parametrize(("lengths", "graph", "bucket"), [
    ([5], "graph_full", 8),            # one request, a small bucket: the whole-step graph
    ([3, 9], "graph_full", 16),        # two requests fill the two request slots
    ([2, 3, 4], "graph", 16),          # three do not: the breakable graph of the same bucket
    ([20], "graph", 32),               # past full_graph_tokens: breakable only
])
def test_a_batch_replays_the_whole_step_graph_when_it_fits(engines: tuple[Engine, Engine], lengths: list[int],
                                                           graph: str, bucket: int) -> None:
    eng, eager = engines
    prompts = random_prompts(lengths, seed=len(lengths))
    res = eng.prefill(prompts)
    (record,) = res.batches
    assert record.graph_used and record.bucket == bucket
    assert record.reason == graph
    want = eager.prefill(prompts).logits
    tol = 1e-5 if eng.dtype == torch.float32 else 2e-2 * want.abs().max().item()  # another attention kernel in bf16
    assert (res.logits - want).abs().max().item() <= tol


def test_the_whole_step_graphs_are_built_verified_and_described(engines: tuple[Engine, Engine]) -> None:
    eng, _ = engines
    full = eng.runner.full
    assert sorted(full.handles) == [8, 16] and sorted(eng.runner.handles) == [8, 16, 32, 64]
    assert full.resources.pool is eng.runner.resources.pool  # one pool: the two graphs' temporaries share memory
    assert all(r.verify_diff is not None and r.disabled_reason is None for r in full.telemetry.buckets.values())
    kind = "static" if eng.dtype == torch.float32 else "static_triton"  # bcg's kernel runs in half precision
    assert full.telemetry.attention_backend == kind
    assert any(n.startswith("full graphs: 2 of buckets 8,16") and kind in n for n in eng.telemetry.notes)
    assert "full graphs up to 16 tokens" in eng.config.describe()
    # A whole-step graph ends at most its request slots' requests: its LM head reads (and casts) that many rows.
    assert full.inputs.static_logits.shape[0] == OPTS["max_requests"] == full.inputs.head_rows(16)
    assert eng.runner.inputs.head_rows(16) == 16


def test_a_failed_whole_step_replay_falls_back_to_the_breakable_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine("tiny-dense", full_graph_tokens=16, **OPTS)

    def broken(self: Any, handle: Any, num_tokens: int) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(FullBackend, "replay", broken)
    prompts = random_prompts([5])
    res = eng.prefill(prompts)
    assert res.batches[0].graph_used and res.batches[0].reason == "graph"  # the breakable graph, not eager
    monkeypatch.undo()
    again = eng.prefill(prompts)  # the whole-step graph serves again once it replays
    assert again.batches[0].reason == "graph_full" and torch.allclose(again.logits, res.logits, atol=1e-5)


def test_runs_only_sends_a_request_in_pieces_to_the_breakable_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """BCG_KV_READS=runs_only: the whole-step graphs read every request's keys by address, so a batch with a
    request whose slots do not run up by one replays its bucket's breakable graph (eager's answer either way)."""
    from bcg import env
    from bcg.runtime.batch import PrefillBatch, PrefillItem

    monkeypatch.setattr(env, "KV_READS", "runs_only")
    eng = Engine("tiny-dense", dtype="bfloat16", full_graph_tokens=16, **OPTS)
    eager = Engine("tiny-dense", backend="eager", dtype="bfloat16", **OPTS)
    assert eng.runner.full.inputs.attention.kv_reads == "runs_only"
    tokens = random_prompts([6])[0]
    want = eager.prefill([tokens]).logits
    for order, reason in (("run", "graph_full"), ("pieces", "graph")):
        slots = eng.kv_pool.alloc(6)
        try:
            batch = PrefillBatch([PrefillItem(tokens, slots if order == "run" else slots.flip(0))], eng.kv_pool)
            out = eng.runner.forward(batch)
            assert out.record.graph_used and out.record.reason == reason
            assert (out.logits - want).abs().max().item() <= 2e-2 * want.abs().max().item()
        finally:
            eng.kv_pool.free(slots)
    # A recapture on a fragmented pool finds no run for its dummy batch: that whole-step bucket is refused, logged,
    # and its batches replay the breakable graph.
    held = eng.kv_pool.alloc(eng.kv_pool.num_free)
    eng.kv_pool.free(held[::2].clone())
    eng.runner.recapture(8)
    eng.kv_pool.free(held[1::2].clone())
    assert "slots_not_in_runs" in eng.runner.full.table.buckets[8].record.disabled_reason
    res = eng.prefill([tokens])
    assert res.batches[0].reason == "graph" and res.batches[0].bucket == 8


@pytest.mark.parametrize(("options", "match"), [
    (dict(backend="full"), r"leave it 0 \(or None\) with backend=.full."),
    (dict(backend="eager"), r"leave it 0 \(or None\) with backend=.eager."),
    (dict(tp_size=2), "tp_size > 1"),
    (dict(full_graph_tokens=-1), "full_graph_tokens"),
])
def test_full_graph_tokens_outside_one_breakable_process_is_refused(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"full_graph_tokens": 64, **options})


def test_served_requests_with_cached_prefixes_replay_the_whole_step_graph() -> None:
    """submit() with the prefix cache: a hit attends to its cached keys inside the whole-step graph (the key capacity
    holds them), and every answer is a lone eager prefill's."""
    eng = Engine("tiny-dense", full_graph_tokens=16, prefix_capacity=64, **OPTS)
    eager = Engine("tiny-dense", backend="eager", prefix_cache=False, **OPTS)
    head = random_prompts([24], seed=7)[0]
    prompts = [head + tail for tail in random_prompts([3, 5, 9], seed=8)]
    first = eng.submit(prompts[0]).result(timeout=60)  # 27 tokens: the breakable graph; its KV is cached
    rest = [eng.submit(p).result(timeout=60) for p in prompts[1:]]
    assert [r.cached_tokens for r in rest] == [24, 24]
    assert all(b.reason == "graph_full" for r in rest for b in r.batches)
    for res, prompt in zip([first, *rest], prompts):
        assert torch.allclose(res.logits, eager.prefill([prompt]).logits, atol=1e-5)
    eng.close()


def test_a_compiled_stack_serves_both_graphs_of_a_bucket() -> None:
    eng = Engine("tiny-dense", full_graph_tokens=16, compile="traced", **OPTS)
    eager = Engine("tiny-dense", backend="eager", **OPTS)
    for lengths, reason in (([5], "graph_full"), ([2, 3, 4], "graph")):
        prompts = random_prompts(lengths, seed=3)
        res = eng.prefill(prompts)
        assert res.batches[0].reason == reason
        assert torch.allclose(res.logits, eager.prefill(prompts).logits, atol=1e-5)


@pytest.mark.parametrize(("options", "want"), [
    (dict(device="cuda"), 2048),                           # one GPU: the default, every bucket of the default chunk
    (dict(device="cuda", chunked_prefill_size=512), 512),  # every bucket of a smaller chunk
    (dict(device="cuda", chunked_prefill_size=8192), 2048),  # not past what was measured
    (dict(device="cuda", full_graph_tokens=0), 0),         # asked off
    (dict(device="cuda", full_graph_tokens=64), 64),       # asked smaller
    (dict(device="cuda", tp_size=2), 0),                   # tensor parallel: the two runners would agree separately
    (dict(device="cuda", backend="full"), 0),              # not breakable
    (dict(device="cpu"), 0),                               # emulated graphs: islands launch nothing
])
def test_full_graphs_are_the_default_of_breakable_on_one_gpu(options: dict, want: int) -> None:
    # kernels and attention given, so resolving "cuda" asks nothing of a device this machine may lack
    cfg = EngineConfig(**{"kernels": "torch", "attention_backend": "varlen", **options}).resolved()
    assert cfg.full_graph_tokens == want
    assert cfg.resolved() == cfg
    assert (f"full graphs up to {want} tokens" in cfg.describe()) == (want > 0)
    assert want <= DEFAULT_FULL_GRAPH_TOKENS


def test_large_buckets_read_runs_only_and_small_ones_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """BCG_KV_READS unset: a bucket up to RUNS_TOKENS reads "runs" (a request in pieces still replays its whole-step
    graph), a larger one "runs_only" (the same request replays the breakable graph; in one run, the whole-step one).
    Eager's answer every time."""
    from bcg import env
    from bcg.ops.attention import static_triton
    from bcg.runtime.batch import PrefillBatch, PrefillItem

    monkeypatch.setattr(env, "KV_READS", None)
    monkeypatch.setattr(static_triton, "RUNS_TOKENS", 8)  # buckets 8 | 16: as 512 | 1024 on a GPU
    eng = Engine("tiny-dense", dtype="bfloat16", full_graph_tokens=16, **OPTS)
    eager = Engine("tiny-dense", backend="eager", dtype="bfloat16", **OPTS)
    attention = eng.runner.full.inputs.attention
    assert attention.kv_reads is None and (attention.reads(8), attention.reads(16)) == ("runs", "runs_only")
    for length, order, reason in ((6, "pieces", "graph_full"), (12, "pieces", "graph"), (12, "run", "graph_full")):
        tokens = random_prompts([length], seed=length)[0]
        want = eager.prefill([tokens]).logits
        slots = eng.kv_pool.alloc(length)
        try:
            batch = PrefillBatch([PrefillItem(tokens, slots if order == "run" else slots.flip(0))], eng.kv_pool)
            out = eng.runner.forward(batch)
            assert out.record.graph_used and out.record.reason == reason, (length, order)
            assert (out.logits - want).abs().max().item() <= 2e-2 * want.abs().max().item()
        finally:
            eng.kv_pool.free(slots)


def test_a_refused_whole_step_graph_leaves_the_breakable_graphs_serving(caplog: pytest.LogCaptureFixture) -> None:
    """A model the whole-step graph cannot hold (the DSA indexer reads the live batch): the refusal is a note and an
    info line naming who serves, not the warning of an engine that serves eagerly; its batches replay breakable."""
    with caplog.at_level("INFO", logger="bcg"):
        eng = Engine("tiny-dsa", full_graph_tokens=16, **OPTS)
    refused = [r for r in caplog.records if "select_topk" in r.getMessage()]
    assert refused and all(r.levelname == "INFO" for r in refused)
    assert refused[0].getMessage().endswith("the breakable graphs serve every batch")
    assert any("refused:" in n for n in eng.telemetry.notes)
    eager = Engine("tiny-dsa", backend="eager", **OPTS)
    prompts = random_prompts([5, 7])
    res = eng.prefill(prompts)
    assert res.batches[0].reason == "graph"
    assert torch.allclose(res.logits, eager.prefill(prompts).logits, atol=1e-5)


def test_enable_and_recapture_bring_back_the_whole_step_graph_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay failures disable a bucket's whole-step graph (the breakable one serves meanwhile); the engine's
    enable_bucket and recapture, which name a bucket, bring back both of its graphs."""
    eng = Engine("tiny-dense", full_graph_tokens=16, max_replay_failures=1, **OPTS)
    prompts = random_prompts([12])  # bucket 16, the largest whole-step graph
    want = eng.prefill(prompts).logits

    def broken(self: Any, handle: Any, num_tokens: int) -> None:
        raise RuntimeError("injected")

    full_table = eng.runner.full.table
    for restore in (lambda: eng.enable_bucket(16), lambda: eng.recapture(16)):
        with monkeypatch.context() as m:
            m.setattr(FullBackend, "replay", broken)
            assert eng.prefill(prompts).batches[0].reason == "graph"
        assert full_table.buckets[16].record.disabled_reason is not None
        assert eng.prefill(prompts).batches[0].reason == "graph"  # still disabled: the breakable graph serves
        restore()
        assert full_table.buckets[16].record.disabled_reason is None
        res = eng.prefill(prompts)
        assert res.batches[0].reason == "graph_full" and torch.allclose(res.logits, want, atol=1e-5)
