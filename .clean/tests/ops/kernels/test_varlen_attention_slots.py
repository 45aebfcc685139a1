"""bcg's varlen attention op reading keys and values through slots (``kv_slots``: attention straight from a KV
pool's layer) and zeroing the rows past the last sequence (``zero_tail``), on the CPU (its reference): equal to the
direct mode on the packed keys, NaN pool rows that no sequence names never read, the refusals, the registered op."""

from __future__ import annotations

import pytest
import torch
from attention_cases import CASES, packed, pooled

from bcg.ops.kernels.attention import varlen_attention


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", ["self", "prefixes", "empty-sequences", "long", "everything"])
def test_slots_read_the_same_keys_as_the_packed_tensors(name, slot_dtype):
    lens_q, lens_k, features = CASES[name]
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=3, **features)
    pool_k, pool_v, slots = pooled(k, v, slot_dtype=slot_dtype)
    direct, slotted = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), direct, **features)
    varlen_attention(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k), slotted, kv_slots=slots, **features)
    assert torch.equal(slotted, direct)  # the NaN rows (unused slots, the pool's other rows) reached no row
    assert slotted[: sum(lens_q)].abs().sum() > 0


def test_zero_tail_writes_zeros_past_the_last_sequence_only():
    lens_q, lens_k = [4, 0, 3, 0], [6, 0, 3, 0]  # trailing sentinel sequences, as a bucket's request slots
    q, k, v, cu_q, cu_k, _ = packed(lens_q, lens_k, extra_q=5)
    pool_k, pool_v, slots = pooled(k, v, unused=4)
    kept, zeroed = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    varlen_attention(q, pool_k, pool_v, cu_q, cu_k, 12, 10, kept, kv_slots=slots)
    varlen_attention(q, pool_k, pool_v, cu_q, cu_k, 12, 10, zeroed, kv_slots=slots, zero_tail=True)
    n = sum(lens_q)
    assert torch.equal(zeroed[:n], kept[:n]) and torch.equal(kept[n:], torch.full_like(kept[n:], 7.0))
    assert torch.equal(zeroed[n:], torch.zeros_like(zeroed[n:]))


@pytest.mark.parametrize(("slots", "message"), [
    (torch.zeros(5), "kv_slots must be a contiguous 1-D int32/int64"),
    (torch.zeros(5, 1, dtype=torch.int64), "kv_slots must be a contiguous 1-D int32/int64"),
    (torch.arange(10)[::2], "kv_slots must be a contiguous 1-D int32/int64"),
])
def test_bad_slots_are_refused_with_the_problem_named(slots, message):
    q, k, v, cu_q, cu_k, _ = packed([5], [5])
    with pytest.raises(RuntimeError, match=message):
        varlen_attention(q, k, v, cu_q, cu_k, 5, 5, torch.empty_like(q), kv_slots=slots)


def test_a_slot_outside_the_pool_fails_the_device_assert():
    q, k, v, cu_q, cu_k, _ = packed([5], [5])
    with pytest.raises(RuntimeError, match="kv_slots must index rows of k/v"):
        varlen_attention(q, k, v, cu_q, cu_k, 5, 5, torch.empty_like(q), kv_slots=torch.tensor([0, 1, 2, 3, 5]))


def test_the_registered_op_takes_slots_and_traces():
    q, k, v, cu_q, cu_k, features = packed([6, 0, 3], [8, 0, 3], extra_q=2, sinks=True)
    pool_k, pool_v, slots = pooled(k, v)
    out, want = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    torch.ops.bcg.varlen_attention_(q, pool_k, pool_v, cu_q, cu_k, 6, 8, out, 0.25, 1.5, 2, features["sinks"],
                                    slots, True)
    varlen_attention(q, k, v, cu_q, cu_k, 6, 8, want, scale=0.25, softcap=1.5, window_left=2, zero_tail=True,
                     **features)
    assert torch.equal(out, want) and (out[9:] == 0).all() and out.abs().sum() > 0
    torch.library.opcheck(torch.ops.bcg.varlen_attention_.default,
                          (q, pool_k, pool_v, cu_q, cu_k, 6, 8, torch.zeros_like(q), 0.25, 1.5, 2, features["sinks"],
                           slots, True), test_utils=("test_schema", "test_faketensor"))


def test_compiled_code_passes_the_slots_to_the_op():
    q, k, v, cu_q, cu_k, _ = packed([4, 3], [5, 3], extra_q=1)
    pool_k, pool_v, slots = pooled(k, v)

    def f(q, out):
        varlen_attention(q * 1, pool_k, pool_v, cu_q, cu_k, 4, 5, out, kv_slots=slots, zero_tail=True)
        return out + 0

    out_e, out_c = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    want = f(q, out_e)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, out_c)
    assert torch.equal(got, want) and torch.equal(out_c, out_e) and (out_c[7:] == 0).all()
