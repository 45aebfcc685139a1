"""KV pool: cache shapes (with the scratch slot) and the slot allocator."""

from __future__ import annotations

import pytest
import torch

from bcg.models.config import get_preset
from bcg.ops.kv_cache import KVPool, KVPoolFullError


def test_shapes_include_scratch_slot():
    pool = KVPool.for_model(get_preset("tiny-dsa"), num_slots=10, device="cpu", dtype=torch.bfloat16)
    config = get_preset("tiny-dsa")
    assert len(pool.k) == len(pool.v) == config.num_layers
    assert pool.k[0].shape == (11, config.num_kv_heads, config.head_dim) and pool.k[0].dtype == torch.bfloat16
    assert len(pool.index_k) == config.num_index_groups == 2 and pool.index_k[1].shape == (11, config.index_head_dim)
    assert pool.scratch_slot == 10
    assert not KVPool.for_model(get_preset("tiny-dense"), 4, "cpu", torch.float32).index_k


def test_alloc_and_free_round_trip():
    pool = KVPool(8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    a, b = pool.alloc(3), pool.alloc(2)
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4] and a.dtype == torch.int64
    assert pool.num_free == 3
    pool.free(a)
    assert pool.num_free == 6
    c = pool.alloc(6)
    assert sorted(c.tolist()) == [0, 1, 2, 5, 6, 7]
    assert pool.alloc(0).numel() == 0


def test_alloc_failure_allocates_nothing_and_names_shortage():
    pool = KVPool(8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    pool.alloc(5)
    with pytest.raises(KVPoolFullError, match=r"requested 4, only 3 of 8 free \(short by 1\)"):
        pool.alloc(4)
    assert pool.num_free == 3
    assert pool.alloc(3).tolist() == [5, 6, 7]


def test_free_rejects_bad_slots():
    pool = KVPool(8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    slots = pool.alloc(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.free(torch.tensor([8]))  # the scratch slot is never allocated
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(torch.tensor([5]))
    with pytest.raises(ValueError, match="duplicated"):
        pool.free(torch.tensor([0, 0]))
    assert pool.num_free == 6
    pool.free(slots)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slots)


def test_pool_built_under_inference_mode_allocates_and_frees_outside_it():
    # Bookkeeping is host-side numpy, so the mode a pool was built (or a slot allocated) in does not matter.
    with torch.inference_mode():
        pool = KVPool(num_slots=6, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        inside = pool.alloc(2)
    outside = pool.alloc(3)
    assert inside.tolist() == [0, 1] and outside.tolist() == [2, 3, 4] and pool.num_free == 1
    pool.free(inside)
    with torch.inference_mode():
        pool.free(outside)
    assert pool.num_free == 6 and sorted(pool.alloc(6).tolist()) == list(range(6))
