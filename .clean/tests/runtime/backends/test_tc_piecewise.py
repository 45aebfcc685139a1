"""The "tc_piecewise" backend on a CPU: torch.compile splits at the islands, pieces captured under emulation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_cache import EngineCache, max_diff, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcg import env
from bcg.models import build_model, get_preset
from bcg.runtime.backends.piecewise import PieceRuntime, PiecewiseCompiler

BUCKETS = [8, 16, 32]
# Inductor's CPU kernels bypass the emulation (see below), so the CPU tier traces pieces with the eager compiler.
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=32, kv_tokens=512, device="cpu",
                     per_backend={"tc_piecewise": {"tc_compiler": "traced"}})
prompts = random_prompts


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(["tiny-dense", "tiny-moe"]),
       lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_random_compositions_match_eager(preset: str, lengths: list[int], seed: int) -> None:
    batch = prompts(lengths, seed)
    ref = engine(preset, "eager").prefill(batch)
    res = engine(preset, "tc_piecewise").prefill(batch)
    assert max_diff(res.logits, ref.logits) <= 1e-5
    assert torch.equal(res.next_tokens, ref.next_tokens)
    assert all(b.graph_used for b in res.batches if b.num_tokens >= 4), res.batches


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_one_trace_pieces_between_attention_islands(preset: str) -> None:
    eng = engine(preset, "tc_piecewise")
    tel, layers = eng.telemetry, eng.model.config.num_layers
    assert tel.refused_reason is None and tel.compile_ms > 0 and tel.capture_ms > 0
    for n in BUCKETS:
        assert (tel.buckets[n].num_segments, tel.buckets[n].num_breaks) == (layers + 1, layers)
    backend = eng.runner.backend
    eng.prefill(prompts([3, 20]))
    eng.prefill(prompts([5]))
    # One dynamic trace serves every bucket: no recompile at capture or replay.
    assert backend.compiler.num_compiles == 1
    assert all(sorted(p.graphs) == BUCKETS for p in backend.compiler.pieces)


def test_replay_goes_through_the_compiled_function(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine("tiny-dense", "tc_piecewise")
    backend, calls = eng.runner.backend, []
    compiled = backend.compiled
    monkeypatch.setattr(backend, "compiled", lambda *a: calls.append(a[0].shape[0]) or compiled(*a))
    monkeypatch.setattr(env, "DEBUG", True)  # also check every piece input is where it was captured
    res = eng.prefill(prompts([6, 7]))
    assert calls == [16] and res.batches[0].graph_used
    assert max_diff(res.logits, engine("tiny-dense", "eager").prefill(prompts([6, 7])).logits) <= 1e-5


def test_chunked_prefill_matches_one_shot() -> None:
    prompt = prompts([70])
    one_shot = engine("tiny-moe", "eager", chunked_prefill_size=128).prefill(prompt)
    chunked = engine("tiny-moe", "tc_piecewise").prefill(prompt)
    assert [b.graph_used for b in chunked.batches] == [True, True, True]
    assert max_diff(chunked.logits, one_shot.logits) <= 1e-5


def test_dsa_is_refused_at_build_and_served_eagerly() -> None:
    eng = engine("tiny-dsa", "tc_piecewise")
    reason = eng.telemetry.refused_reason
    assert reason is not None and "BackendRefused" in reason and "select_topk" in reason and "breakable" in reason
    assert eng.telemetry.capture_ms == 0 and not eng.runner.handles
    batch = prompts([3, 7, 12, 1])
    res = eng.prefill(batch)
    assert [b.reason for b in res.batches] == ["backend_refused"]
    assert max_diff(res.logits, engine("tiny-dsa", "eager").prefill(batch).logits) == 0


def test_inductor_under_emulation_is_refused_with_the_fix() -> None:
    eng = engine("tiny-dense", "tc_piecewise", tc_compiler="inductor")
    assert "tc_compiler='traced'" in eng.telemetry.refused_reason
    assert "GPU. Use backend='breakable'" in eng.telemetry.refused_reason  # sentences end before the hint
    assert eng.prefill(prompts([5])).batches[0].reason == "backend_refused"


def test_inductor_pieces_compile_and_match_eager_without_graphs() -> None:
    from bcg.ops import custom_ops  # noqa: F401 - registers the islands for tracing
    from bcg.ops.context import forward_context
    from bcg.ops.kv_cache import KVPool
    from bcg.runtime.batch import PrefillBatch, PrefillItem

    # One layer keeps the (cold) Inductor compile short: two pieces around one island.
    model = build_model(replace(get_preset("tiny-dense"), num_layers=1), "cpu", torch.float32, seed=0)
    pool = KVPool.for_model(model.config, 64, "cpu", torch.float32)
    compiler = PiecewiseCompiler(PieceRuntime(), "inductor")

    def step(hidden: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(model.forward_layers(hidden, positions))

    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    # Views of max-size buffers, as the runner passes its static buffers.
    hidden, positions, out = torch.zeros(24, 64), torch.zeros(24, dtype=torch.long), torch.zeros(24, 64)
    for n, dynamic in ((24, True), (12, False)):
        slots = pool.alloc(n)
        try:
            batch = PrefillBatch([PrefillItem(torch.arange(n // 3), slots[:n // 3]),
                                  PrefillItem(torch.arange(n - n // 3) * 7 % 256, slots[n // 3:])], pool)
            hidden[:n], positions[:n] = model.embed(batch.input_ids), batch.positions
            args = (hidden[:n], positions[:n], out[:n])
            if dynamic:
                for t in args:
                    torch._dynamo.mark_dynamic(t, 0)
            with torch.inference_mode(), forward_context(batch.to_context(n)):
                compiled(*args)
                ref = model.forward_layers(hidden[:n], positions[:n])
        finally:
            pool.free(slots)
        assert max_diff(out[:n], ref) <= 1e-5
    assert compiler.num_compiles == 1 and compiler.num_pieces == 2 and compiler.num_islands == 1


def test_telemetry_has_the_same_shape_for_every_backend() -> None:
    shapes = {}
    for name in ("eager", "breakable", "full", "tc_piecewise"):
        eng = engine("tiny-dense", name, **({"max_requests": 4} if name == "full" else {}))
        eng.prefill(prompts([5, 6]))
        d = eng.telemetry.to_dict()
        batch_keys = {tuple(sorted(vars(b))) for b in eng.telemetry.batches}
        shapes[name] = (tuple(sorted(d)), tuple(sorted(batch_keys)))
        if name != "eager":  # the graph backends: one record per bucket, build time split in two
            assert sorted(eng.telemetry.buckets) == BUCKETS and eng.telemetry.batches[-1].graph_used
            assert {tuple(sorted(r)) for r in d["buckets"]} == {tuple(sorted(vars(eng.telemetry.buckets[8])))}
            assert d["compile_ms"] >= 0 and d["capture_ms"] > 0 and d["num_captured"] == len(BUCKETS)
    assert len(set(shapes.values())) == 1, shapes
