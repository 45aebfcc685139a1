"""Attention with a sliding window, sinks, soft-capping, a scale and a V head dim of its own, over packed requests with
cached prefixes: the island against a naive dense computation written the way transformers' eager code does it."""

from __future__ import annotations

import pytest
import torch

from bcg.ops.attention import attention
from bcg.ops.attention import features as attention_features
from bcg.ops.attention.features import AttentionFeatures, feature_attention, reference_attention, visible_keys
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.runtime.batch import PrefillBatch, PrefillItem

# (new tokens, cached prefix) per request; prefixes longer than the windows tested
LAYOUT = [(4, 6), (1, 0), (7, 9), (3, 0)]
FEATURES = {
    "window": dict(window=3),
    "sinks": dict(sinks=True),
    "window+sinks": dict(window=4, sinks=True),
    "softcap": dict(softcap=2.0),
    "window+softcap+scale": dict(window=2, softcap=1.5, scale=0.3),
    "scale": dict(scale=0.05),
}


def _setup(num_heads=4, num_kv_heads=2, head_dim=16, v_dim=16, device="cpu", dtype=torch.float32, padded=32):
    pool = KVPool.for_layers([{"k": (num_kv_heads, head_dim), "v": (num_kv_heads, v_dim)}] * 2, 64, device, dtype)
    items = [PrefillItem(list(range(n)), pool.alloc(n), p, pool.alloc(p)) for n, p in LAYOUT]
    gen = torch.Generator().manual_seed(0)
    for item in items:
        pool.k[1][item.prefix_slots] = torch.randn(item.prefix_len, num_kv_heads, head_dim, generator=gen).to(device,
                                                                                                             dtype)
        pool.v[1][item.prefix_slots] = torch.randn(item.prefix_len, num_kv_heads, v_dim, generator=gen).to(device,
                                                                                                           dtype)
    ctx = PrefillBatch(items, pool).to_context(padded)
    q = torch.randn(padded, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(padded, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(padded, num_kv_heads, v_dim, generator=gen).to(device, dtype)
    sinks = torch.randn(num_heads, generator=gen).to(device, dtype)
    return ctx, items, q, k, v, sinks


def _features(spec: dict, sinks: torch.Tensor) -> AttentionFeatures:
    return AttentionFeatures(spec.get("scale"), spec.get("window"), spec.get("softcap"),
                             sinks if spec.get("sinks") else None)


def _naive(ctx, items, q, f: AttentionFeatures):
    """transformers' eager attention per request, in double: masked logits, soft-cap, softmax over [logits, sink]
    with the sink column dropped; window: key position > query position - W."""
    pool, outs, row = ctx.kv_pool, [], 0
    for item in items:
        slots = torch.cat([item.prefix_slots, item.new_slots]).to(q.device)
        keys, values = pool.k[1][slots].double(), pool.v[1][slots].double()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        qs = q[row : row + item.num_new_tokens].double()
        scale = f.scale if f.scale is not None else q.shape[-1] ** -0.5
        logits = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        if f.softcap is not None:
            logits = torch.tanh(logits / f.softcap) * f.softcap
        q_pos = torch.arange(item.prefix_len, item.prefix_len + qs.shape[0])[:, None]
        k_pos = torch.arange(keys.shape[0])[None]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - f.window) if f.window is not None else True)
        logits = logits.masked_fill(~visible.to(q.device), float("-inf"))
        if f.sinks is not None:
            sink = f.sinks.double()[:, None, None].expand(-1, qs.shape[0], 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = logits.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        row += item.num_new_tokens
    return torch.cat(outs)


@pytest.mark.parametrize("spec", FEATURES.values(), ids=FEATURES.keys())
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "v_dim"), [(4, 2, 16), (4, 4, 12)], ids=["gqa", "v-dim-12"])
def test_island_with_features_matches_naive(spec, num_heads, num_kv_heads, v_dim):
    ctx, items, q, k, v, sinks = _setup(num_heads, num_kv_heads, v_dim=v_dim)
    f = _features(spec, sinks)
    out = torch.full((q.shape[0], num_heads, v_dim), float("nan"))
    with forward_context(ctx):
        attention(q, k, v, out, 1, f.scale, f.window, f.softcap, f.sinks)
    n = ctx.num_tokens
    torch.testing.assert_close(out[:n].double(), _naive(ctx, items, q, f), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # padded rows zeroed
    assert torch.equal(ctx.kv_pool.k[1][ctx.write_slots[:n]], k[:n])  # real rows' K/V written


def test_each_feature_matters():
    """Negative control: the naive reference tells every feature apart from plain attention."""
    ctx, items, q, _, _, sinks = _setup()
    plain = _naive(ctx, items, q, AttentionFeatures())
    for spec in FEATURES.values():
        assert (_naive(ctx, items, q, _features(spec, sinks)) - plain).abs().max() > 1e-2


def test_visible_keys_follow_transformers_sliding_window():
    # a query at position p sees p - W + 1 .. p: with W = 3 and a prefix of 4, query 0 (position 4) sees 2, 3, 4
    assert visible_keys(2, 4, 3, "cpu").int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert visible_keys(2, 1, None, "cpu").int().tolist() == [[1, 1, 0], [1, 1, 1]]


def test_describe_names_every_feature():
    f = AttentionFeatures(scale=0.25, window=128, softcap=50.0, sinks=torch.zeros(2))
    assert f.describe() == "sliding window 128, attention sinks, logit soft-cap 50.0, scale 0.25"


# ------------------------------------------------------------------ CUDA: FlashAttention with a window and the LSE
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [FEATURES["window"], FEATURES["sinks"], FEATURES["window+sinks"],
                                  dict(window=4, sinks=True, scale=0.2), dict(window=1000)],
                         ids=["window", "sinks", "window+sinks", "window+sinks+scale", "window-wider-than-keys"])
def test_flash_path_matches_reference_in_bf16(spec):
    ctx, items, q, k, v, sinks = _setup(8, 2, head_dim=64, v_dim=64, device="cuda", dtype=torch.bfloat16)
    f = _features(spec, sinks)
    assert attention_features.flash_features_usable(q.device), "FlashAttention with a window should work on CUDA"
    n = ctx.num_tokens
    ctx.store_kv(1, k, v)
    keys, values = ctx.keys_values(1, k, v)
    got, want = torch.empty_like(q[:n]), torch.empty_like(q[:n])
    assert attention_features._use_flash(q[:n], values, ctx, f)
    feature_attention(q[:n], keys, values, ctx, f, got)
    reference_attention(q[:n], keys, values, ctx, f, want)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(got.double(), _naive(ctx, items, q, f).to(got.device), atol=3e-2, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_softcap_runs_the_reference_on_cuda():
    ctx, items, q, k, v, sinks = _setup(8, 2, head_dim=64, v_dim=64, device="cuda", dtype=torch.bfloat16)
    f = AttentionFeatures(window=4, softcap=2.0)
    assert not attention_features._use_flash(q, v, ctx, f)  # torch's FlashAttention has no soft-cap
    out = torch.empty_like(q)
    with forward_context(ctx):
        attention(q, k, v, out, 1, f.scale, f.window, f.softcap, f.sinks)
    n = ctx.num_tokens
    torch.testing.assert_close(out[:n].double(), _naive(ctx, items, q, f).to(out.device), atol=3e-2, rtol=0)
