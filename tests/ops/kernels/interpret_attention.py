"""The Triton varlen attention kernel under Triton's interpreter, against the op's reference and the oracle.

Run as ``TRITON_INTERPRET=1 python -m pytest tests/ops/kernels/interpret_attention.py`` (not ``test_*``: the
interpreter must be on before anything imports Triton; ``test_varlen_attention.py`` runs it that way). The
interpreter truncates fp32 -> bf16, so bf16 gets one more unit of tolerance than the compiled kernel would need.
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_cases import CASES, oracle, packed, pooled, runs_pooled

from bcg.ops.kernels.attention import varlen_attention_reference

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 from the start"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernel"),
]
TOL = {torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module")
def ta():
    from bcg.ops.kernels import triton_attention, triton_utils

    assert triton_utils.INTERPRETING
    return triton_attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_oracle(ta, name, dtype):
    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=2, dtype=dtype, **features)
    got, ref = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    ta.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), got, **features)
    varlen_attention_reference(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), ref, **features)
    want = oracle(q, k, v, lens_q, lens_k, **features)
    n = sum(lens_q)
    assert (got[:n].double() - want[:n]).abs().max().item() <= TOL[dtype]
    assert (got[:n].float() - ref[:n].float()).abs().max().item() <= TOL[dtype]
    assert torch.equal(got[n:], torch.full_like(got[n:], 7.0))


@pytest.mark.parametrize("dim", [64, 40])
def test_head_dims_and_block_configs(ta, dim):
    """A head dim that is not a power of two (masked columns), and each block configuration (short and long)."""
    lens_q, lens_k = [70, 5], [90, 5]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, heads=4, kv_heads=1, dim=dim, dtype=torch.float16)
    want = oracle(q, k, v, lens_q, lens_k, softcap=3.0)
    for cfg in (ta.block_config(dim, 8), ta.block_config(dim, 4096), ta.BlockConfig(16, 32, 4, 1)):
        got = torch.empty_like(q)
        ta.varlen_attention(q, k, v, cu_q, cu_k, 70, 90, got, softcap=3.0, config=cfg)
        assert (got.double() - want).abs().max().item() <= TOL[torch.float16], cfg


@pytest.mark.parametrize("window_left", [None, 20, 45])
def test_blocks_seen_in_full_skip_the_masks(ta, window_left):
    """Small blocks over long sequences: most key blocks lie wholly inside a program's causal band (and window) and
    take the unmasked loop, the diagonal's and the window edge's the masked one. Against the oracle, and the same
    bits as the kernel with every block masked (a full block has nothing to mask)."""
    lens_q, lens_k = [70, 33], [150, 33]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, heads=2, kv_heads=1, dtype=torch.float16,
                                           window_left=window_left)
    want = oracle(q, k, v, lens_q, lens_k, **features)
    split, masked = torch.empty_like(q), torch.empty_like(q)
    for out, split_mask in ((split, True), (masked, False)):
        ta.varlen_attention(q, k, v, cu_q, cu_k, 70, 150, out, config=ta.BlockConfig(16, 16, 4, 1, split_mask),
                            **features)
    assert (split.double() - want).abs().max().item() <= TOL[torch.float16]
    assert torch.equal(split, masked)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", ["prefixes", "empty-sequences", "long", "everything"])
def test_slot_mode_reads_the_pool_in_place(ta, name, slot_dtype):
    """Keys through ``kv_slots`` from a pool whose other rows are NaN, rows past the last sequence zeroed: the same
    numbers as the direct mode on the packed keys, and as the reference given the same slots."""
    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=5, **features)
    pool_k, pool_v, slots = pooled(k, v, slot_dtype=slot_dtype)
    direct, got, ref, split = (torch.full_like(q, 7.0) for _ in range(4))
    ta.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), direct, **features)
    ta.varlen_attention(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k), got, kv_slots=slots,
                        zero_tail=True, **features)
    # Small blocks with the split loop: the unmasked blocks read their slots with no mask either.
    ta.varlen_attention(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k), split, kv_slots=slots,
                        zero_tail=True, config=ta.BlockConfig(16, 16, 4, 1, split_mask=True), **features)
    assert (split.float() - got.float()).abs().max().item() <= TOL[torch.bfloat16]
    assert torch.equal(split[sum(lens_q):], torch.zeros_like(split[sum(lens_q):]))
    varlen_attention_reference(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k), ref, kv_slots=slots,
                               zero_tail=True, **features)
    n = sum(lens_q)
    assert torch.equal(got[:n], direct[:n]) and got[:n].abs().sum() > 0
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))  # the tail, written by the same launch
    assert (got.float() - ref.float()).abs().max().item() <= TOL[torch.bfloat16]


def test_zero_tail_covers_a_tail_longer_than_the_longest_sequence(ta):
    """A bucket with few real rows: the tail (more rows than max_seqlen_q would cover) is zeroed in full."""
    q, k, v, cu_q, cu_k, _ = packed([3, 0, 0], [5, 0, 0], extra_q=150)
    pool_k, pool_v, slots = pooled(k, v, unused=20)
    got = torch.full_like(q, 7.0)
    ta.varlen_attention(q, pool_k, pool_v, cu_q, cu_k, 3, 25, got, kv_slots=slots, zero_tail=True)
    want = oracle(q, k, v, [3, 0, 0], [5, 0, 0])
    assert (got[:3].double() - want[:3]).abs().max().item() <= TOL[torch.bfloat16]
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))


@pytest.mark.parametrize("name", ["self", "prefixes", "empty-sequences", "long", "everything"])
def test_runs_of_slots_read_by_address_give_the_slot_modes_bits(ta, name):
    """``kv_base``: a sequence whose slots run up by one is read by address, the others through their slots; the
    same bits as the slot mode alone (the same keys in the same order), and a broken promise reads other rows."""
    from bcg.ops.kv_cache import run_starts

    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=5, **features)
    pool_k, pool_v, slots = runs_pooled(k, v, lens_k)
    base = torch.from_numpy(run_starts(slots.numpy(), cu_k.numpy()))
    assert base.tolist() == [int(slots[s]) if n and (i % 2 == 0 or n == 1) else -1  # one key is a run too
                             for i, (s, n) in enumerate(zip(cu_k[:-1].tolist(), lens_k))]
    args = (q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k))
    through, by_address, split = (torch.full_like(q, 7.0) for _ in range(3))
    ta.varlen_attention(*args, through, kv_slots=slots, zero_tail=True, **features)
    ta.varlen_attention(*args, by_address, kv_slots=slots, zero_tail=True, kv_base=base, **features)
    ta.varlen_attention(*args, split, kv_slots=slots, zero_tail=True, kv_base=base,
                        config=ta.BlockConfig(16, 16, 4, 1, split_mask=True), **features)
    assert torch.equal(by_address, through) and through[: sum(lens_q)].abs().sum() > 0
    assert (split.float() - through.float()).abs().max().item() <= TOL[torch.bfloat16]
    if (base >= 0).any():
        wrong, shifted = torch.full_like(q, 7.0), torch.where(base >= 0, base - 2, base)
        ta.varlen_attention(*args, wrong, kv_slots=slots, zero_tail=True, kv_base=shifted, **features)
        assert wrong.isnan().any()  # the rows before a run are the pool's NaN gap


@pytest.mark.parametrize("name", ["self", "prefixes", "empty-sequences", "long", "everything"])
def test_kv_base_alone_reads_every_sequence_by_address(ta, name):
    """``kv_base`` without ``kv_slots`` (a whole-step graph whose requests each hold one run): key ``j`` of sequence
    ``s`` at pool row ``kv_base[s] + j``; the slot mode's bits on the same pool, the reference's within tolerance."""
    from bcg.ops.kernels.attention import varlen_attention_reference
    from bcg.ops.kv_cache import run_starts

    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=5, **features)
    pool_k, pool_v, slots = runs_pooled(k, v, lens_k, every=1)
    base = torch.from_numpy(run_starts(slots.numpy(), cu_k.numpy()))
    assert all((b >= 0) == (n > 0) for b, n in zip(base.tolist(), lens_k))
    args = (q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k))
    through, by_address, ref = (torch.full_like(q, 7.0) for _ in range(3))
    ta.varlen_attention(*args, through, kv_slots=slots, zero_tail=True, **features)
    ta.varlen_attention(*args, by_address, zero_tail=True, kv_base=base, **features)
    varlen_attention_reference(*args, ref, zero_tail=True, kv_base=base, **features)
    assert torch.equal(by_address, through) and through[: sum(lens_q)].abs().sum() > 0
    assert (ref.float() - through.float()).abs().max().item() <= TOL[torch.bfloat16]


@pytest.mark.parametrize("name", ["self", "prefixes", "empty-sequences", "long", "everything"])
@pytest.mark.parametrize("reads", ["direct", "slots", "slots+base", "base"])
def test_the_flat_grid_gives_the_per_sequence_grids_bits(ta, name, reads):
    """``flat_grid``: one program per row block a sequence has (plus the tail's) computes what the per-sequence
    grid does, bit for bit, in every key mode, the zeroed tail included and rows of no sequence left alone."""
    from bcg.ops.kv_cache import run_starts

    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=70, **features)
    extra = {}
    if reads != "direct":
        k, v, slots = runs_pooled(k, v, lens_k, every=1 if reads == "base" else 2)
        base = torch.from_numpy(run_starts(slots.numpy(), cu_k.numpy()))
        extra = {"slots": dict(kv_slots=slots), "slots+base": dict(kv_slots=slots, kv_base=base),
                 "base": dict(kv_base=base)}[reads]
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    for zero_tail in (False, True):
        per_seq, flat = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
        ta.varlen_attention(*args, per_seq, zero_tail=zero_tail, flat_grid=False, **extra, **features)
        ta.varlen_attention(*args, flat, zero_tail=zero_tail, flat_grid=True, **extra, **features)
        assert torch.equal(flat, per_seq) and per_seq[: sum(lens_q)].abs().sum() > 0
        assert torch.equal(flat[sum(lens_q):] == 0, torch.full_like(flat[sum(lens_q):], zero_tail, dtype=torch.bool))


def test_the_flat_grid_searches_more_sequences_than_its_smallest_width(ta):
    """21 sequences (the search's width rounds up to 32), empty ones among them, with cached prefixes."""
    gen = torch.Generator().manual_seed(5)
    lens_q = torch.randint(0, 6, (21,), generator=gen).tolist()
    lens_k = [n + int(p) for n, p in zip(lens_q, torch.randint(0, 4, (21,), generator=gen))]
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, extra_q=9)
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    per_seq, flat = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    ta.varlen_attention(*args, per_seq, zero_tail=True, flat_grid=False, config=ta.BlockConfig(16, 16, 4, 1))
    ta.varlen_attention(*args, flat, zero_tail=True, flat_grid=True, config=ta.BlockConfig(16, 16, 4, 1))
    assert torch.equal(flat, per_seq)
    want = oracle(q, k, v, lens_q, lens_k)
    n = sum(lens_q)
    assert (flat[:n].double() - want[:n]).abs().max().item() <= TOL[torch.bfloat16]
