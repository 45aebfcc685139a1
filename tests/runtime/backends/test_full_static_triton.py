"""The "full" backend with ``attention_backend="static_triton"`` on the CPU, as the GPU runs it: bcg's varlen
kernel (its reference here, in bf16) reads every layer's keys straight from the KV pool through the static read
slots inside one emulated graph per bucket, against eager SDPA: several buckets, padded rows, sentinel request
slots, chunked prompts and prefix-cache hits, over a NaN scratch slot; and the context's one call per layer."""

from __future__ import annotations

import pytest
import torch
from engine_cache import check_prefix_hits, poison_scratch, same_answer

import bcg.ops.attention.static as static_module
from bcg.ops.attention import StaticAttention, StaticContext, StaticTritonAttention, attention, attention_backend
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.runtime import Engine
from bcg.runtime.batch import PrefillBatch, PrefillItem

BUCKETS = [4, 8, 16, 32]
COMMON = dict(device="cpu", dtype="bfloat16", progress=False, seed=0, buckets=BUCKETS, chunked_prefill_size=32)
TOL = 5e-2  # bf16 logits of a 2-layer model


@pytest.fixture(scope="module")
def engines():
    eng = Engine("tiny-dense", backend="full", attention_backend="static_triton", prefix_cache=True, max_requests=4,
                 prefix_capacity=64, **COMMON)
    ref = Engine("tiny-dense", backend="eager", attention_backend="sdpa", prefix_cache=False, **COMMON)
    yield eng, ref
    eng.close()
    ref.close()




def test_the_option_is_selectable_and_says_where_it_cannot_run(engines):
    eng, _ = engines
    assert attention_backend("static_triton") is StaticTritonAttention
    assert eng.telemetry.attention_backend == "static_triton" and eng.telemetry.refused_reason is None
    attn = eng.runner.inputs.attention
    assert isinstance(attn, StaticTritonAttention) and attn.use_slot_kernel and not attn.use_varlen
    assert not StaticAttention.use_slot_kernel  # the default "static" keeps gather + FlashAttention / masked SDPA
    assert "float16/bfloat16" in StaticTritonAttention.is_usable(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="attention_backend='static_triton' cannot run here"):
        Engine("tiny-dense", backend="full", device="cpu", dtype="float32", attention_backend="static_triton",
               progress=False, buckets=[8])
    with pytest.raises(ValueError, match="'static' or 'static_triton'"):
        Engine("tiny-dense", backend="full", device="cpu", dtype="bfloat16", attention_backend="sdpa",
               progress=False, buckets=[8])


@pytest.mark.parametrize(("name", "lengths"), [
    ("one-token", [1]),  # bucket 4: three padded rows, three sentinel request slots
    ("fills-bucket", [5, 3]),  # bucket 8, no padded row rewrites the (NaN) scratch slot; unused keys name it
    ("padded", [5, 3, 2]),  # bucket 16, six padded rows
    ("four-requests", [9, 1, 12, 7]),  # bucket 32, every request slot live
    ("chunked", [75, 3]),  # 3 chunks: later chunks attend over the cached earlier ones (prefix keys)
])
def test_prefill_matches_eager_sdpa(engines, name, lengths):
    eng, ref = engines
    gen = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(0, eng.model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    poison_scratch(eng)
    got, want = eng.prefill(prompts), ref.prefill(prompts)
    same_answer(got, want, TOL)
    assert got.logits.isfinite().all()
    assert all(b.graph_used for b in got.batches), [b.reason for b in got.batches]
    if name == "chunked":
        assert [b.num_tokens for b in got.batches] == [32, 32, 14]  # every chunk a replay, the later two a prefix


def test_prefix_cache_hits_and_repeats_match_eager_sdpa(engines):
    """A shared system prompt cut at different tokens (hits end anywhere), and an exact repeat (its last token runs
    again as a one-token request after a 42-token prefix)."""
    check_prefix_hits(*engines, TOL)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2)])
def test_one_kernel_call_over_the_pool_matches_the_gathering_path(monkeypatch, num_heads, num_kv_heads):
    """The context hands the pool's layer and the read slots to the kernel (no gather here) and asks it to zero the
    padded rows; the result equals the default static attention's (gather + masked attention), padded rows 0."""
    head_dim, layout, bucket = 16, [(4, 3), (1, 0), (7, 10), (2, 1)], 16
    pools = [KVPool(64, 1, num_kv_heads, head_dim, torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    items = [PrefillItem(list(range(n)), pools[0].alloc(n), p, pools[0].alloc(p)) for n, p in layout]
    for pool in pools[1:]:  # same slots in the second pool
        pool.alloc(sum(n + p for n, p in layout))
    prefix = torch.randn(65, num_kv_heads, head_dim, generator=gen).bfloat16()
    for pool in pools:
        pool.k[0].copy_(prefix)
        pool.v[0].copy_(prefix.flip(0))
        pool.k[0][pool.scratch_slot] = pool.v[0][pool.scratch_slot] = float("nan")
    q = torch.randn(bucket, num_heads, head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(bucket, num_kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    calls = []
    real = static_module.varlen_attention

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(static_module, "varlen_attention", spy)
    outs = []
    for pool, backend in zip(pools, (StaticAttention(pools[0], 6, 16, use_varlen=False),
                                     StaticTritonAttention(pools[1], 6, 16, kv_reads="slots"))):
        out = torch.full_like(q, float("nan"))
        with forward_context(PrefillBatch(items, pool).to_context(bucket, backend)) as ctx:
            assert isinstance(ctx, StaticContext)
            attention(q, k, v, out, 0)
        outs.append(out)
    (args, kwargs), = calls  # only the slot path called the kernel, once
    assert args[1] is pools[1].k[0] and args[2] is pools[1].v[0] and args[5:7] == (bucket, bucket + 16)
    assert kwargs["kv_slots"] is ctx.read_slots and kwargs["zero_tail"] is True
    assert kwargs["kv_base"] is None  # kv_reads="slots": every key through its slot
    n = sum(n for n, _ in layout)
    assert (outs[1][:n].float() - outs[0][:n].float()).abs().max().item() <= 2e-2
    assert (outs[1][n:] == 0).all() and outs[1].isfinite().all()


def test_a_buckets_context_is_made_once_and_never_carries_a_batch(engines):
    """The context over a bucket's arena views holds nothing of a batch, so the runner's loads of that bucket hand
    out one object; fields staged anywhere else (an eager batch's own) get a context of their own."""
    eng, _ = engines
    inputs = eng.runner.inputs
    pool = eng.kv_pool
    batches = [PrefillBatch([PrefillItem(list(range(1, n + 1)), pool.alloc(n))], pool) for n in (3, 6)]
    try:
        first, second = (inputs.load(b, 8).context for b in batches)
        assert first is second and first.cu_seqlens is inputs.layouts[8].views["cu_seqlens"]
        assert inputs.load(batches[0], 16).context is not first  # another bucket, other views
        own = {"cu_seqlens": torch.zeros(10, dtype=torch.int32), "write_slots": torch.zeros(8, dtype=torch.int64),
               "read_slots": torch.zeros(8, dtype=torch.int64)}
        live = inputs.attention.context(batches[0], 8, own)
        assert live is not first and live.write_slots is own["write_slots"]
        again = inputs.load(batches[1], 8).context  # over the arena's views again
        assert again is not live and again.write_slots is inputs.layouts[8].views["write_slots"]
    finally:
        for b in batches:
            pool.free(torch.from_numpy(b.host_write_slots.copy()))


def _prefill_through(eng, ref, tokens, slot_order):
    """One request of ``tokens`` whose new slots the pool hands out in ``slot_order`` (``"run"``: as allocated;
    ``"pieces"``: reversed), through ``eng``'s runner: its record and its logits beside eager SDPA's."""
    pool = eng.kv_pool
    slots = pool.alloc(len(tokens))
    try:
        batch = PrefillBatch([PrefillItem(tokens, slots if slot_order == "run" else slots.flip(0))], pool)
        out = eng.runner.forward(batch)
        want = ref.prefill([tokens]).logits.float()
        assert (out.logits.float() - want).abs().max().item() <= TOL
        return out.record, batch
    finally:
        pool.free(slots)


@pytest.mark.parametrize("kv_reads", ["runs", "runs_only"])
def test_runs_of_slots_read_by_address_answer_as_eager(kv_reads: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BCG_KV_READS: each request's first slot where its slots run up by one rides in the bucket's fields and
    reaches the kernel (its reference reads by the same rows); a request in pieces is read through its slots
    (``runs``) or does not fit the graph (``runs_only``: reason ``slots_not_in_runs``, eager's answer either way)."""
    from bcg import env

    monkeypatch.setattr(env, "KV_READS", kv_reads)  # the switch, read once at import
    eng = Engine("tiny-dense", backend="full", attention_backend="static_triton", prefix_cache=False,
                 max_requests=4, **COMMON)
    assert eng.runner.inputs.attention.kv_reads == kv_reads
    ref = Engine("tiny-dense", backend="eager", attention_backend="sdpa", prefix_cache=False, **COMMON)
    try:
        assert "kv_base" in eng.runner.inputs.layouts[16].views
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 200, (n,), generator=gen) for n in (5, 3, 6)]
        res = eng.prefill(prompts)
        same_answer(res, ref.prefill(prompts), TOL)
        assert res.batches[0].graph_used and res.batches[0].bucket == 16
        # The bucket's field holds what the batch staged: a fresh pool hands each prompt one run of slots, and the
        # sentinel request slot has none.
        bases = eng.runner.inputs.layouts[16].views["kv_base"].tolist()
        assert all(b >= 0 for b in bases[:3]) and bases[3] == -1 and len(set(bases[:3])) == 3
        tokens = torch.randint(1, 200, (7,), generator=gen).tolist()
        record, _ = _prefill_through(eng, ref, tokens, "run")
        assert record.graph_used
        record, batch = _prefill_through(eng, ref, tokens, "pieces")
        assert batch.host_run_starts.tolist() == [-1]
        assert record.graph_used == (kv_reads == "runs")
        assert record.reason == ("slots_not_in_runs" if kv_reads == "runs_only" else "graph")
        ctx = eng.runner.inputs.attention.context(batch, 8, eng.runner.inputs.layouts[8].views)
        assert (ctx.kv_slots is None) == (kv_reads == "runs_only")  # what the captured kernel call was given
    finally:
        eng.close()
        ref.close()


def test_kv_reads_takes_three_values_or_goes_by_bucket() -> None:
    from bcg.ops.attention.static_triton import RUNS_TOKENS

    pool = KVPool(16, 1, 1, 8, torch.bfloat16)
    by_bucket = StaticTritonAttention(pool)  # BCG_KV_READS unset
    assert by_bucket.kv_reads is None
    assert (by_bucket.reads(RUNS_TOKENS), by_bucket.reads(RUNS_TOKENS + 1)) == ("runs", "runs_only")
    assert StaticTritonAttention(pool, kv_reads="slots").reads(4 * RUNS_TOKENS) == "slots"
    with pytest.raises(ValueError, match="kv_reads='pages'"):
        StaticTritonAttention(pool, kv_reads="pages")
