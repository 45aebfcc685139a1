"""The attention call: the K/V write in the segment (padded rows to the scratch slot), then causal attention with
prefixes in the island, through each island backend: SDPA, and FlashAttention varlen (its reference on the CPU, in
bf16 as the kernel wants; the kernel itself in the CUDA tier)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.ops import flash
from bcg.ops.attention import BatchContext, VarlenAttention, attention, attention_backend, sdpa_attention
from bcg.ops.context import forward_context
from bcg.ops.flash_reference import reference_flash_varlen
from bcg.ops.kv_cache import KVPool
from bcg.runtime.batch import PrefillBatch, PrefillItem

# (new tokens, cached prefix) per request
LAYOUTS = {
    "no-prefix": [(5, 0), (1, 0), (9, 0)],
    "prefix": [(4, 3), (1, 0), (7, 10), (2, 1)],
    "one-token": [(1, 0)],  # the serving soak's crash when it fills its bucket (GQA, an empty padded sequence)
    "one-token-each": [(1, 0), (1, 0)],
    "one-token-prefixes": [(1, 5), (1, 3)],  # every sequence one query, after a cached prefix
}
# Island backends, the dtype each runs in on the CPU and its tolerance against the double-precision reference.
BACKENDS = {"sdpa": (torch.float32, 1e-5), "varlen": (torch.bfloat16, 2e-2)}


def _setup(layout, num_heads, num_kv_heads, num_padded, device="cpu", dtype=torch.float32, head_dim=16,
           backend=None):
    pool = KVPool(64, num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    items = [PrefillItem(list(range(n)), pool.alloc(n), p, pool.alloc(p)) for n, p in layout]
    gen = torch.Generator().manual_seed(0)
    for item in items:  # cached prefixes hold earlier chunks' K/V
        for cache in (pool.k[1], pool.v[1]):
            prefix = torch.randn(item.prefix_len, num_kv_heads, head_dim, generator=gen)
            cache[item.prefix_slots] = prefix.to(device, dtype)
    if num_padded is None:  # the batch fills its bucket
        num_padded = sum(n for n, _ in layout)
    ctx = PrefillBatch(items, pool).to_context(num_padded, backend and attention_backend(backend)(pool))
    q = torch.randn(num_padded, num_heads, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(num_padded, num_kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    return ctx, items, q, k, v


def _naive(ctx: BatchContext, items, q, layer_id=1):
    """softmax(QK^T / sqrt(d)) V per request, query i seeing keys 0..prefix+i, from the pool."""
    pool, outs, row = ctx.kv_pool, [], 0
    for item in items:
        slots = torch.cat([item.prefix_slots, item.new_slots]).to(q.device)
        keys, values = pool.k[layer_id][slots].double(), pool.v[layer_id][slots].double()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        qs = q[row : row + item.num_new_tokens].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) / q.shape[-1] ** 0.5
        visible = torch.ones(qs.shape[0], keys.shape[0], dtype=torch.bool, device=q.device).tril(item.prefix_len)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        row += item.num_new_tokens
    return torch.cat(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_padded", [40, None], ids=["padded", "fills-bucket"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_island_matches_naive_reference(layout, num_heads, num_kv_heads, num_padded, backend):
    dtype, tol = BACKENDS[backend]
    ctx, items, q, k, v = _setup(LAYOUTS[layout], num_heads, num_kv_heads, num_padded, dtype=dtype, backend=backend)
    assert ctx.backend.name == backend
    out = torch.full_like(q, float("nan"))
    prefix_state = [c.clone() for c in (ctx.kv_pool.k[1], ctx.kv_pool.v[1])]
    with forward_context(ctx):
        attention(q, k, v, out, 1)
    n = ctx.num_tokens
    assert (out[:n].double() - _naive(ctx, items, q)).abs().max() <= tol
    # Every padded row written and finite: zeros, or (varlen without a prefix) the padded rows among themselves.
    assert out[n:].isfinite().all()
    if backend == "sdpa" or ctx.has_prefix:
        assert (out[n:] == 0).all()
    # Real rows land at their slots, padded ones in the scratch slot; no other slot changes; layer 0 untouched.
    pool = ctx.kv_pool
    real = ctx.write_slots[:n]
    assert torch.equal(pool.k[1][real], k[:n]) and torch.equal(pool.v[1][real], v[:n])
    assert (ctx.write_slots[n:] == pool.scratch_slot).all()
    other = torch.ones(pool.num_slots + 1, dtype=torch.bool)
    other[ctx.write_slots] = False
    assert torch.equal(pool.k[1][other], prefix_state[0][other])
    assert torch.equal(pool.v[1][other], prefix_state[1][other])
    assert not pool.k[0].any() and not pool.v[0].any()


def test_gather_returns_prefix_then_new_keys():
    ctx, items, q, k, v = _setup(LAYOUTS["prefix"], 4, 2, num_padded=30)
    ctx.store_kv(1, k, v)
    keys, _ = ctx.keys_values(1, k, v)
    first = items[0]
    assert torch.equal(keys[: first.prefix_len], ctx.kv_pool.k[1][first.prefix_slots])
    assert torch.equal(keys[first.prefix_len : first.prefix_len + first.num_new_tokens], k[: first.num_new_tokens])


def test_island_outside_context_raises():
    q = torch.zeros(2, 1, 4)
    with pytest.raises(RuntimeError, match="no ForwardContext"):
        attention(q, q, q, q, 0)


def test_the_serving_soaks_batch_through_the_varlen_island():
    """The H200 soak's failing forward: one 1-token request filling its bucket, 4 heads over 2 K/V heads, head_dim
    16. The padded rows' sequence is empty (cu [0, 1, 1]) and the longest query 1: FlashAttention-2 takes its
    one-query-per-sequence GQA path and fails the reshape. The island passes an upper bound of 2 instead."""
    ctx, items, q, k, v = _setup(LAYOUTS["one-token"], 4, 2, None, dtype=torch.bfloat16, backend="varlen")
    assert ctx.padded_cu_seqlens.tolist() == [0, 1, 1] and ctx.padded_max_seqlen == 1
    ctx.store_kv(1, k, v)
    with pytest.raises(RuntimeError, match=r"shape '\[2, 2, 2, 16\]' is invalid for input of size 64"):
        reference_flash_varlen(q, k, v, ctx.padded_cu_seqlens, ctx.padded_cu_seqlens, 1, 1, is_causal=True)
    out = torch.full_like(q, float("nan"))
    with forward_context(ctx):
        attention(q, k, v, out, 1)
    assert (out.double() - _naive(ctx, items, q)).abs().max() <= 1e-2


def test_the_copy_after_the_kernel_is_logged_once_and_noted(monkeypatch, caplog):
    from bcg.ops.attention import varlen

    pool = KVPool(8, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert VarlenAttention(pool).notes == []  # the reference writes in place
    monkeypatch.setattr(varlen, "copy_reason", lambda device: "torch 0.0 has no in-place route (a test's words)")
    varlen._log_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="bcg.ops.attention.varlen"):
        first, second = VarlenAttention(pool), VarlenAttention(pool)
    assert first.notes == second.notes == ["varlen attention: torch 0.0 has no in-place route (a test's words)"]
    assert caplog.text.count("no in-place route") == 1
    varlen._log_once.cache_clear()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(flash.varlen_attn is None, reason="torch without varlen_attn")
@pytest.mark.parametrize("num_padded", [48, None], ids=["padded", "fills-bucket"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_island_matches_sdpa_reference_bf16(layout, num_padded):
    ctx, items, q, k, v = _setup(LAYOUTS[layout], 8, 2, num_padded, device="cuda", dtype=torch.bfloat16,
                                 head_dim=128)
    assert ctx.backend.name == "varlen"
    out = torch.full_like(q, float("nan"))
    with forward_context(ctx):
        attention(q, k, v, out, 1)
    n = ctx.num_tokens
    keys, values = ctx.keys_values(1, k, v)
    reference = sdpa_attention(q[:n], keys, values, ctx).float()
    assert (out[:n].float() - reference).abs().max() <= 2e-2
    assert out[n:].isfinite().all()  # every padded row written (they attend among themselves, or are zeroed)
    assert (out[:n].float() - _naive(ctx, items, q).float()).abs().max() <= 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(flash.varlen_attn is None, reason="torch without varlen_attn")
def test_varlen_island_launches_one_kernel_when_no_request_has_a_prefix():
    """One flash kernel where the torch build writes in place (2.13: the in-place aten op / varlen_attn_out); where
    it cannot (2.11) the kernel and exactly one device-to-device copy, and the backend says why."""
    ctx, _, q, k, v = _setup(LAYOUTS["no-prefix"], 8, 2, num_padded=48, device="cuda", dtype=torch.bfloat16,
                             head_dim=128)
    out = torch.full_like(q, float("nan"))
    ctx.store_kv(1, k, v)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ctx.attend(q, k, v, out, 1)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    reason = flash.copy_reason(q.device)
    inplace_op = flash._FLASH_INPLACE if flash.uses_aten_flash(q.device) else flash.varlen_attn_out
    has_inplace = inplace_op is not None  # torch 2.13 has both in-place routes, torch 2.11 neither
    assert (reason is None) == has_inplace, reason
    flash_kernels = [n for n in names if "flash" in n.lower()]
    assert len(flash_kernels) == 1, names
    if reason is None:
        assert names == flash_kernels and ctx.backend.notes == []
    else:
        assert len(names) == 2 and "memcpy" in names[1].lower(), names
        assert ctx.backend.notes == [f"varlen attention: {reason}"]
    assert out.isfinite().all()


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in (torch.ops.aten.detach.default, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _stub_flash(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, out=None):
    """Stands in for the FlashAttention kernel on the CPU: one aten op, like the one kernel it launches."""
    _stub_flash.calls.append((cu_q.tolist(), max_q))
    out.copy_(q)
    return out


@pytest.mark.parametrize(("layout", "num_padded", "expected"), [
    ("no-prefix", 15, ["copy_"]),  # fills its bucket: the kernel alone
    ("no-prefix", 40, ["copy_"]),  # padded: the padded rows are one more sequence of the same kernel
    ("prefix", 40, ["index", "index", "copy_", "zero_"]),  # gathers the cached key ranges, zeroes the padded rows
])
def test_the_varlen_island_launches_only_its_kernel(monkeypatch, layout, num_padded, expected):
    from bcg.ops.attention import VarlenAttention, varlen

    monkeypatch.setattr(varlen, "flash_varlen", _stub_flash)
    monkeypatch.setattr(varlen, "varlen_causal_is_bottom_right", lambda device: True)
    _stub_flash.calls = []
    pool = KVPool(64, num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    items = [PrefillItem(list(range(n)), pool.alloc(n), p, pool.alloc(p)) for n, p in LAYOUTS[layout]]
    ctx = PrefillBatch(items, pool).to_context(num_padded, VarlenAttention(pool))
    q = torch.randn(num_padded, 4, 16)
    k, v = torch.randn(num_padded, 2, 16), torch.randn(num_padded, 2, 16)
    out = torch.empty_like(q)
    ctx.store_kv(1, k, v)  # in the graph segment, not the island
    with _CountOps() as counter:
        ctx.attend(q, k, v, out, 1)
    assert counter.ops == expected
    if layout == "no-prefix":
        n = ctx.num_tokens
        padded_run = [num_padded] if num_padded > n else [n]
        assert _stub_flash.calls == [([0, 5, 6, 15, *padded_run], max(9, num_padded - n))]
