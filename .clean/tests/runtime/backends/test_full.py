"""The "full" backend under CPU graph emulation: attention inside one graph per bucket, static metadata, fallbacks."""

from __future__ import annotations

import pytest
import torch
from engine_cache import EngineCache, max_diff, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcg.ops.attention import StaticAttention, StaticContext, attention
from bcg.ops.attention.static import PAD_KEY, PAD_QUERY
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.runtime.batch import PrefillBatch, PrefillItem

BUCKETS = [8, 16, 32]
SLOTS = 6
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=32, kv_tokens=512, device="cpu",
                     per_backend={"full": {"max_requests": SLOTS}})
prompts = random_prompts


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(["tiny-dense", "tiny-moe"]),
       lengths=st.lists(st.integers(1, 24), min_size=1, max_size=SLOTS), seed=st.integers(0, 2**16))
def test_random_compositions_match_eager(preset: str, lengths: list[int], seed: int) -> None:
    batch = prompts(lengths, seed)
    ref = engine(preset, "eager").prefill(batch)
    res = engine(preset, "full", prefix_capacity=128).prefill(batch)
    assert max_diff(res.logits, ref.logits) <= 1e-5
    assert torch.equal(res.next_tokens, ref.next_tokens)
    # Every forward fits: at most SLOTS requests, at most 32 tokens, keys within 32 + 128.
    assert all(b.graph_used for b in res.batches if b.num_tokens * 2 >= min(BUCKETS)), res.batches


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_one_graph_per_bucket_and_graphs_are_used(preset: str) -> None:
    eng = engine(preset, "full")
    assert eng.telemetry.refused_reason is None
    assert {n: (r.num_segments, r.num_breaks) for n, r in eng.telemetry.buckets.items()} == {
        n: (1, 0) for n in BUCKETS}
    res = eng.prefill(prompts([3, 7, 12, 1]))
    assert [(b.graph_used, b.bucket) for b in res.batches] == [(True, 32)]
    assert max_diff(res.logits, engine(preset, "eager").prefill(prompts([3, 7, 12, 1])).logits) <= 1e-5


def test_attention_replays_inside_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, calls = engine("tiny-moe", "full"), []
    monkeypatch.setattr(StaticContext, "attend", lambda *args: calls.append(args))
    batch = prompts([9, 4, 2])
    res = eng.prefill(batch)
    assert res.batches[0].graph_used and calls == []  # no Python attention ran: the graph holds it
    assert max_diff(res.logits, engine("tiny-moe", "eager").prefill(batch).logits) <= 1e-5


def test_more_requests_than_slots_run_eagerly_with_the_reason() -> None:
    batch = prompts([2] * (SLOTS + 1))
    res = engine("tiny-dense", "full").prefill(batch)
    assert [(b.graph_used, b.reason) for b in res.batches] == [(False, "too_many_requests")]
    assert max_diff(res.logits, engine("tiny-dense", "eager").prefill(batch).logits) <= 1e-5


def test_more_tokens_than_the_largest_bucket_run_eagerly() -> None:
    res = engine("tiny-dense", "full", chunked_prefill_size=64).prefill(prompts([40, 10]))
    assert [(b.graph_used, b.reason) for b in res.batches] == [(False, "exceeds_max_bucket")]


def test_sentinel_slots_never_leak_between_batches() -> None:
    eng, ref = engine("tiny-dense", "full"), engine("tiny-dense", "eager")
    five, two = prompts([3, 4, 2, 5, 1], seed=1), prompts([6, 5], seed=2)
    for batch in (five, two, five, two):
        res = eng.prefill(batch)
        assert res.batches[0].graph_used and res.batches[0].bucket == 16
        assert max_diff(res.logits, ref.prefill(batch).logits) <= 1e-5
    # After the 2-request batch every unused slot, row and key of bucket 16 holds its sentinel.
    runner = eng.runner
    ctx = runner.inputs.attention.context(None, 16, runner.inputs.layouts[16].views)
    cu_q, cu_k = ctx.cu_seqlens_q.tolist(), ctx.cu_seqlens_k.tolist()
    assert cu_q[:3] == [0, 6, 11] and cu_q[3:] == [11] * (SLOTS - 2)
    assert cu_k[:3] == [0, 6, 11] and cu_k[3:] == [11] * (SLOTS - 2)
    assert (ctx.query_request[11:] == PAD_QUERY).all() and (ctx.key_request[11:] == PAD_KEY).all()
    scratch = eng.kv_pool.scratch_slot
    assert (ctx.write_slots[11:] == scratch).all() and (ctx.read_slots[11:] == scratch).all()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_chunked_prefill_attends_to_the_cached_prefix(preset: str) -> None:
    prompt = prompts([70])
    one_shot = engine(preset, "eager", chunked_prefill_size=128).prefill(prompt)
    chunked = engine(preset, "full", prefix_capacity=64).prefill(prompt)  # chunks of 32: prefixes 32 and 64
    assert [(b.graph_used, b.num_tokens) for b in chunked.batches] == [(True, 32), (True, 32), (True, 6)]
    assert max_diff(chunked.logits, one_shot.logits) <= 1e-5


def test_keys_beyond_the_capacity_run_eagerly_with_the_reason() -> None:
    prompt = prompts([70])
    res = engine("tiny-dense", "full").prefill(prompt)  # default prefix capacity: one chunk (32 keys)
    assert [(b.graph_used, b.reason) for b in res.batches] == [(True, "graph"), (True, "graph"),
                                                              (False, "too_many_keys")]
    ref = engine("tiny-dense", "eager", chunked_prefill_size=128).prefill(prompt)
    assert max_diff(res.logits, ref.logits) <= 1e-5


def test_padded_rows_write_only_the_scratch_slot() -> None:
    eng = engine("tiny-dense", "full")
    for cache in eng.kv_pool.k:
        cache.zero_()
    eng.prefill(prompts([5]))  # bucket 8: three padded rows
    k = eng.kv_pool.k[0]
    assert k[:5].abs().sum() > 0 and k[5 : eng.kv_pool.scratch_slot].abs().sum().item() == 0


def test_dsa_is_refused_with_the_op_named_and_served_eagerly() -> None:
    eng = engine("tiny-dsa", "full")
    reason = eng.telemetry.refused_reason
    assert reason is not None and "select_topk" in reason and "key ranges" in reason and "breakable" in reason
    assert not eng.runner.handles and all(r.disabled_reason == reason for r in eng.telemetry.buckets.values())
    batch = prompts([3, 7, 12, 1])
    res = eng.prefill(batch)
    assert [b.reason for b in res.batches] == ["backend_refused"]
    assert max_diff(res.logits, engine("tiny-dsa", "eager").prefill(batch).logits) == 0


def test_a_non_finite_scratch_slot_cannot_poison_real_rows() -> None:
    eng, ref = engine("tiny-dense", "full"), engine("tiny-dense", "eager")
    batch = prompts([5, 3])  # fills bucket 8 (no padded row rewrites the scratch slot); key capacity 8 + 32
    scratch = eng.kv_pool.scratch_slot
    for cache in (*eng.kv_pool.k, *eng.kv_pool.v):
        cache[scratch] = float("nan")
    eng.runner.inputs.attention.use_varlen = False  # the masked path reads the unused key slots (scratch)
    res = eng.prefill(batch)
    assert res.batches[0].graph_used and res.logits.isfinite().all()
    assert max_diff(res.logits, ref.prefill(batch).logits) <= 1e-5


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2)])
def test_static_attention_matches_the_live_island(num_heads: int, num_kv_heads: int) -> None:
    head_dim, layout, bucket = 16, [(4, 3), (1, 0), (7, 10), (2, 1)], 16
    pools = [KVPool(64, 1, num_kv_heads, head_dim, torch.float32) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    items = [PrefillItem(list(range(n)), pools[0].alloc(n), p, pools[0].alloc(p)) for n, p in layout]
    for pool in pools[1:]:  # same slots in the second pool
        pool.alloc(sum(n + p for n, p in layout))
    prefix = torch.randn(65, num_kv_heads, head_dim, generator=gen)
    for pool in pools:
        pool.k[0].copy_(prefix)
        pool.v[0].copy_(prefix.flip(0))
    q = torch.randn(bucket, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(bucket, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    live = PrefillBatch(items, pools[0])
    out_live, out_static = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    with forward_context(live.to_context(bucket)):
        attention(q, k, v, out_live, 0)
    static = StaticAttention(pools[1], max_requests=6, prefix_capacity=16, use_varlen=False)
    with forward_context(PrefillBatch(items, pools[1]).to_context(bucket, static)) as ctx:
        assert isinstance(ctx, StaticContext)
        attention(q, k, v, out_static, 0)
    assert max_diff(out_static, out_live) <= 1e-5 and (out_static[live.num_tokens:] == 0).all()
    n = live.num_tokens
    assert torch.equal(pools[1].k[0][:64], pools[0].k[0][:64])  # same KV writes, padded rows aside
    assert torch.equal(pools[1].k[0][pools[1].scratch_slot], k[n:][-1])
