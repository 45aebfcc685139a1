"""The compiled Triton varlen kernel on CUDA: against aten's FlashAttention in bf16 at the GPU presets' attention
shapes (plain causal, prefixes, empty sequences, a left window), against the double oracle for what FlashAttention
lacks (soft-caps, sinks), in place into ``out``, and captured in a CUDA graph; keys read through slots from a pool
(``kv_slots``) with the tail zeroed (``zero_tail``), equal to the direct mode and replayed in a graph."""

from __future__ import annotations

import pytest
import torch
from attention_cases import CASES, oracle, packed, pooled, runs_pooled

from bcg.ops.flash import flash_varlen, flash_varlen_lse
from bcg.ops.kernels.attention import varlen_attention

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16
# (query heads, kv heads, head dim): llama-dense's and the Llama-3.2-1B shape's attention, and a small-head GQA.
SHAPES = [(32, 8, 128), (32, 8, 64), (8, 1, 64)]
BATCHES = {  # (query lengths, key lengths)
    "64": ([64], [64]),
    "256": ([256], [256]),
    "2048": ([2048], [2048]),
    "packed-with-prefixes": ([100, 37, 0, 500, 1], [100, 300, 0, 777, 9]),
    "one-query-each": ([1, 1, 1], [1, 17, 200]),
}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_flash_attention(shape, batch):
    heads, kv_heads, dim = shape
    lens_q, lens_k = BATCHES[batch]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, heads, kv_heads, dim, dtype=BF16, device="cuda")
    want = flash_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True)
    out = torch.full_like(q, float("nan"))
    got = varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out)
    assert got is out
    assert _max_err(out, want) <= 1.6e-2  # a couple of bf16 units at |o| <= ~1


@pytest.mark.parametrize("window_left", [0, 7, 127, 511])
def test_window_matches_flash_attention(window_left):
    lens_q, lens_k = [300, 5], [700, 5]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, 32, 8, 128, dtype=BF16, device="cuda")
    want = torch.empty_like(q)
    lse = flash_varlen_lse(q, k, v, cu_q, cu_k, 300, 700, want, window_left=window_left)
    if lse is None:
        pytest.skip("this torch's aten FlashAttention has no window argument to compare against")
    got = torch.empty_like(q)
    varlen_attention(q, k, v, cu_q, cu_k, 300, 700, got, window_left=window_left)
    assert _max_err(got, want) <= 1.6e-2


@pytest.mark.parametrize("window_left", [None, 200])
def test_unmasked_key_blocks_match_every_block_masked(window_left):
    """The loop over key blocks seen in full (no masks) against the kernel with every block masked, compiled."""
    from bcg.ops.kernels.triton_attention import BlockConfig, block_config
    from bcg.ops.kernels.triton_attention import varlen_attention as launch

    lens_q, lens_k = [1000, 48], [1500, 48]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, 32, 8, 128, dtype=BF16, device="cuda")
    base = block_config(128, 1000)
    split, masked = torch.empty_like(q), torch.empty_like(q)
    for out, split_mask in ((split, True), (masked, False)):
        cfg = BlockConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, split_mask)
        launch(q, k, v, cu_q, cu_k, 1000, 1500, out, window_left=window_left, config=cfg)
    assert _max_err(split, masked) <= 1.6e-2
    want = oracle(q, k, v, lens_q, lens_k, window_left=window_left)
    assert (split.double().cpu() - want).abs().max() <= 1.6e-2


@pytest.mark.parametrize("name", list(CASES))
def test_every_case_matches_the_oracle(name):
    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, 8, 2, 64, extra_q=3, dtype=BF16, device="cuda",
                                           **features)
    out = torch.full_like(q, 7.0)
    varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out, **features)
    n = sum(lens_q)
    assert (out[:n].double().cpu() - oracle(q, k, v, lens_q, lens_k, **features)[:n]).abs().max() <= 1.6e-2
    assert torch.equal(out[n:], torch.full_like(out[n:], 7.0))  # in place: rows of no sequence untouched


def test_captured_in_a_cuda_graph_and_replayed_on_new_lengths():
    """No host read: warm up (compile), capture over fixed buffers, change the lengths in place, replay."""
    q, k, v, cu_q, cu_k, _ = packed([40, 24], [40, 24], 32, 8, 128, dtype=BF16, device="cuda")
    out = torch.zeros_like(q)
    varlen_attention(q, k, v, cu_q, cu_k, 64, 64, out, softcap=30.0)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        varlen_attention(q, k, v, cu_q, cu_k, 64, 64, out, softcap=30.0)
    new_cu = torch.tensor([0, 10, 64], dtype=torch.int32, device="cuda")
    cu_q.copy_(new_cu)
    cu_k.copy_(new_cu)
    graph.replay()
    want = torch.empty_like(q)
    varlen_attention(q, k, v, new_cu, new_cu, 64, 64, want, softcap=30.0, impl="torch")
    assert _max_err(out, want) <= 1.6e-2


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("batch", ["packed-with-prefixes", "2048"])
def test_slot_mode_equals_the_direct_mode_and_zeroes_the_tail(batch, slot_dtype):
    lens_q, lens_k = BATCHES[batch]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, 32, 8, 128, extra_q=70, dtype=BF16, device="cuda")
    pool_k, pool_v, slots = pooled(k, v, unused=50, slot_dtype=slot_dtype)  # every row no sequence names is NaN
    direct, got = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), direct)
    varlen_attention(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k), got, kv_slots=slots, zero_tail=True)
    n = sum(lens_q)
    assert torch.equal(got[:n], direct[:n]) and torch.equal(got[n:], torch.zeros_like(got[n:]))


@pytest.mark.parametrize("batch", ["packed-with-prefixes", "2048"])
def test_runs_of_slots_read_by_address_give_the_slot_modes_bits(batch):
    """``kv_base`` (BCG_KV_READS=runs): the compiled kernel's address path for runs of slots, beside the slot path for
    the rest, against the slot mode alone: the same keys in the same order (the interpreter gives the same bits; the
    compiled loops may schedule differently, so within the file's tolerance here)."""
    from bcg.ops.kv_cache import run_starts

    lens_q, lens_k = BATCHES[batch]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, 32, 8, 128, extra_q=70, dtype=BF16, device="cuda")
    pool_k, pool_v, slots = runs_pooled(k, v, lens_k)
    base = torch.from_numpy(run_starts(slots.cpu().numpy(), cu_k.cpu().numpy())).to("cuda")
    through, by_address = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    args = (q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k))
    varlen_attention(*args, through, kv_slots=slots, zero_tail=True)
    varlen_attention(*args, by_address, kv_slots=slots, zero_tail=True, kv_base=base)
    assert (base >= 0).any() and not by_address.isnan().any()
    assert _max_err(by_address, through) <= 1.6e-2


@pytest.mark.parametrize("batch", ["packed-with-prefixes", "2048"])
def test_kv_base_alone_reads_every_sequence_by_address(batch):
    """``kv_base`` without ``kv_slots`` (every request one run of slots: the whole-step graphs' ``runs_only``
    reads): the compiled kernel's single key loop from each sequence's base, against the slot mode."""
    from bcg.ops.kv_cache import run_starts

    lens_q, lens_k = BATCHES[batch]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, 32, 8, 128, extra_q=70, dtype=BF16, device="cuda")
    pool_k, pool_v, slots = runs_pooled(k, v, lens_k, every=1)
    base = torch.from_numpy(run_starts(slots.cpu().numpy(), cu_k.cpu().numpy())).to("cuda")
    through, by_address = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    args = (q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k))
    varlen_attention(*args, through, kv_slots=slots, zero_tail=True)
    varlen_attention(*args, by_address, zero_tail=True, kv_base=base)
    assert not by_address.isnan().any()
    assert _max_err(by_address, through) <= 1.6e-2


@pytest.mark.parametrize("batch", ["packed-with-prefixes", "2048"])
def test_the_flat_grid_computes_what_the_per_sequence_grid_does(batch):
    """``flat_grid`` (BCG_VARLEN_GRID=flat), compiled: directly and by address from the pool, with the tail zeroed,
    within the file's tolerance of the per-sequence grid (the programs' work is the same; the block search differs)."""
    from bcg.ops.kernels import triton_attention
    from bcg.ops.kv_cache import run_starts

    lens_q, lens_k = BATCHES[batch]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, 32, 8, 128, extra_q=70, dtype=BF16, device="cuda")
    pool_k, pool_v, slots = runs_pooled(k, v, lens_k, every=1)
    base = torch.from_numpy(run_starts(slots.cpu().numpy(), cu_k.cpu().numpy())).to("cuda")
    for keys, extra in (((k, v), {}), ((pool_k, pool_v), dict(kv_base=base))):
        per_seq, flat = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
        args = (q, *keys, cu_q, cu_k, max(lens_q), max(lens_k))
        triton_attention.varlen_attention(*args, per_seq, zero_tail=True, flat_grid=False, **extra)
        triton_attention.varlen_attention(*args, flat, zero_tail=True, flat_grid=True, **extra)
        n = sum(lens_q)
        assert _max_err(flat[:n], per_seq[:n]) <= 1.6e-2 and not flat.isnan().any()
        assert torch.equal(flat[n:], torch.zeros_like(flat[n:]))


def test_slot_mode_captured_in_a_cuda_graph_as_the_full_backend_runs_it():
    """A bucket of 64 rows, 4 request slots, a key capacity of 96 read from a NaN pool: capture once, then new
    lengths, slots and sentinels written in place; the replay equals the reference on the new metadata."""
    bucket, capacity = 64, 96
    gen = torch.Generator().manual_seed(3)
    pool_k, pool_v = (torch.randn(300, 8, 128, generator=gen).to("cuda", BF16) for _ in range(2))
    q = torch.randn(bucket, 32, 128, generator=gen).to("cuda", BF16)
    cu_q = torch.tensor([0, 30, 64, 64, 64], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 50, 84, 84, 84], dtype=torch.int32, device="cuda")
    slots = torch.randperm(299, generator=gen)[:capacity].to("cuda")
    out = torch.full_like(q, float("nan"))
    args = (q, pool_k, pool_v, cu_q, cu_k, bucket, capacity, out)
    varlen_attention(*args, kv_slots=slots, zero_tail=True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        varlen_attention(*args, kv_slots=slots, zero_tail=True)
    pool_k[299] = pool_v[299] = float("nan")  # the scratch slot, named by the unused key slots below
    cu_q.copy_(torch.tensor([0, 5, 12, 12, 12], dtype=torch.int32))  # two live requests, two sentinels, 52 padded
    cu_k.copy_(torch.tensor([0, 25, 32, 32, 32], dtype=torch.int32))
    slots[32:] = 299
    out.fill_(float("nan"))
    graph.replay()
    want = torch.full_like(q, float("nan"))
    varlen_attention(*args[:7], want, kv_slots=slots, zero_tail=True, impl="torch")
    assert _max_err(out, want) <= 1.6e-2 and torch.equal(out[12:], torch.zeros_like(out[12:]))
