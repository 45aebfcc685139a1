"""PrefillBatch packing and the forward context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bcg.ops.context import forward_context, get_forward_context
from bcg.ops.kv_cache import KVPool
from bcg.runtime.batch import PrefillBatch, PrefillItem


@pytest.fixture
def pool() -> KVPool:
    return KVPool(32, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def test_packing(pool):
    prefix = pool.alloc(3)
    first, second, third = pool.alloc(2), pool.alloc(4), pool.alloc(1)
    batch = PrefillBatch(
        [PrefillItem([10, 11], first), PrefillItem([20, 21, 22, 23], second, 3, prefix), PrefillItem([30], third)], pool
    )
    assert (batch.num_tokens, batch.num_requests) == (7, 3)
    assert batch.input_ids.tolist() == [10, 11, 20, 21, 22, 23, 30]
    assert batch.positions.tolist() == [0, 1, 3, 4, 5, 6, 0]
    assert batch.logits_indices.tolist() == [1, 5, 6]
    assert batch.write_slots.tolist() == torch.cat([first, second, third]).tolist()
    assert batch.read_slots.tolist() == torch.cat([first, prefix, second, third]).tolist()

    ctx = batch.to_context(num_padded_tokens=16)
    assert ctx.cu_seqlens_q.tolist() == [0, 2, 6, 7] and ctx.cu_seqlens_q.dtype == torch.int32
    assert ctx.cu_seqlens_k.tolist() == [0, 2, 9, 10] and ctx.cu_seqlens_k.dtype == torch.int32
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (4, 7)
    assert (ctx.num_tokens, ctx.num_padded_tokens, ctx.num_requests) == (7, 16, 3)
    assert ctx.seq_lens_k == [2, 7, 1] and ctx.has_prefix and ctx.kv_pool is pool


@pytest.mark.parametrize(
    ("make_items", "message"),
    [
        (lambda: [], "at least one item"),
        (lambda: [PrefillItem([], [])], "at least one new token"),
        (lambda: [PrefillItem([1, 2], [0])], "2 new tokens but 1 new slots"),
        (lambda: [PrefillItem([1], [0], prefix_len=2, prefix_slots=[1])], "prefix_len=2 but 1 prefix slots"),
        (lambda: [PrefillItem([1], [32])], "out of range"),  # 32 is the scratch slot
        (lambda: [PrefillItem([1], [3]), PrefillItem([2], [3])], "twice"),
    ],
)
def test_invalid_batches(pool, make_items, message):
    with pytest.raises(ValueError, match=message):
        PrefillBatch(make_items(), pool)


def test_padding_must_cover_real_tokens(pool):
    batch = PrefillBatch([PrefillItem([1, 2, 3], pool.alloc(3))], pool)
    with pytest.raises(ValueError, match="num_padded_tokens"):
        batch.to_context(2)


def test_forward_context_nests_and_resets(pool):
    outer = PrefillBatch([PrefillItem([1], pool.alloc(1))], pool).to_context(4)
    inner = PrefillBatch([PrefillItem([1, 2], pool.alloc(2))], pool).to_context(8)
    with pytest.raises(RuntimeError, match="no ForwardContext"):
        get_forward_context()
    with forward_context(outer):
        with forward_context(inner):
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    with pytest.raises(RuntimeError, match="no ForwardContext"):
        get_forward_context()


FIELDS = ("input_ids", "positions", "write_slots", "read_slots", "logits_indices", "cu_seqlens_q", "cu_seqlens_k")


@pytest.mark.parametrize("with_prefix", [True, False])
@pytest.mark.parametrize("check", [True, False])
def test_arrays_build_the_same_batch_as_items(pool, with_prefix: bool, check: bool):
    prefix = pool.alloc(3) if with_prefix else torch.empty(0, dtype=torch.long)
    first, second, third = pool.alloc(2), pool.alloc(4), pool.alloc(1)
    p = prefix.numel()
    a = PrefillBatch([PrefillItem([10, 11], first), PrefillItem([20, 21, 22, 23], second, p, prefix),
                      PrefillItem([30], third)], pool, logit_requests=[0, 2])
    ids = np.array([10, 11, 20, 21, 22, 23, 30])
    b = PrefillBatch.from_arrays(pool, ids, torch.cat([first, second, third]).numpy(), [2, 4, 1], [0, p, 0],
                                 torch.cat([first, prefix, second, third]).numpy(), logit_requests=[0, 2], check=check)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.max_seqlen_q, a.max_seqlen_k, a.has_prefix, a.num_logit_rows) == (
        b.max_seqlen_q, b.max_seqlen_k, b.has_prefix, b.num_logit_rows) == (4, 4 + p, with_prefix, 2)
    assert b.seq_lens_q == [2, 4, 1] and b.prefix_lens == [0, p, 0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 2], [0, 1], [1, 1], [0, 0]), None),  # valid: the reference for the cases below
        (([1, 2], [0, 1], [2, 0], [0, 0]), "at least one new token"),
        (([1, 2], [0], [1, 1], [0, 0]), "2 new tokens by seq_lens_q"),
        (([1, 2], [0, 1], [1, 1], [0, 2]), "read_slots"),  # a prefix needs read slots
        (([1, 2], [0, 32], [1, 1], [0, 0]), "out of range"),  # 32 is the scratch slot
        (([1, 2], [3, 3], [1, 1], [0, 0]), "twice"),
    ],
)
def test_invalid_arrays_are_refused_with_the_field_named(pool, args, message):
    ids, slots, seq, prefix = args
    make = lambda: PrefillBatch.from_arrays(pool, np.array(ids), np.array(slots), seq, prefix)  # noqa: E731
    if message is None:
        assert make().num_tokens == 2
        return
    with pytest.raises(ValueError, match=message):
        make()
