"""DSA attention: the indexer's top-k selection and sparse attention against a masked dense reference, the
FlashAttention layout of the picks, and how little of it runs eagerly."""

from __future__ import annotations

import pytest
import torch

from bcg.models.config import ModelConfig, get_preset
from bcg.ops import dsa as dsa_module
from bcg.ops.context import forward_context
from bcg.ops.dsa import pick_plan, picked_attention, select_topk, sparse_attention
from bcg.ops.kv_cache import KVPool
from bcg.runtime.batch import PrefillBatch, PrefillItem

TOL = 1e-5


def _dsa_context(
    config: ModelConfig, seq_lens_q: list[int], prefix_lens: list[int], num_padded: int,
    device: str = "cpu", dtype: torch.dtype = torch.float32,
):
    pool = KVPool.for_model(config, 128, device, dtype)
    items = []
    for len_q, prefix_len in zip(seq_lens_q, prefix_lens):
        prefix = pool.alloc(prefix_len)
        items.append(PrefillItem(list(range(len_q)), pool.alloc(len_q), prefix_len, prefix))
    # Random cached prefix contents, as if earlier chunks had run.
    gen = torch.Generator().manual_seed(11)
    for cache in [*pool.k, *pool.v, *pool.index_k]:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return PrefillBatch(items, pool).to_context(num_padded)


def test_dsa_selection_and_sparse_attention_match_masked_dense():
    config = get_preset("tiny-dsa")
    seq_lens_q, prefix_lens, num_padded, topk = [5, 12, 1], [0, 6, 9], 24, config.index_topk
    ctx = _dsa_context(config, seq_lens_q, prefix_lens, num_padded)
    gen = torch.Generator().manual_seed(2)
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = (torch.randn(num_padded, h, d, generator=gen) for h in (hq, hkv, hkv))
    index_q = torch.randn(num_padded, config.index_n_heads, config.index_head_dim, generator=gen)
    index_k = torch.randn(num_padded, config.index_head_dim, generator=gen)
    head_weights = torch.randn(num_padded, config.index_n_heads, generator=gen)
    out = torch.full_like(q, float("nan"))
    with forward_context(ctx):
        selection = select_topk(index_q, index_k, head_weights, 0, topk)
        sparse_attention(q, k, v, pick_plan(selection, q), out, 0)
    assert selection.shape == (num_padded, topk) and selection.dtype == torch.int64
    n = ctx.num_tokens
    assert (selection[n:] == -1).all() and (out[n:] == 0).all()

    pool, row = ctx.kv_pool, 0
    for r, (len_q, prefix_len) in enumerate(zip(seq_lens_q, prefix_lens)):
        slots = ctx.read_slots[int(ctx.cu_seqlens_k[r]) : int(ctx.cu_seqlens_k[r + 1])]
        keys, values, ikeys = pool.k[0][slots], pool.v[0][slots], pool.index_k[0][slots]
        position = {int(s): j for j, s in enumerate(slots)}  # the selection holds pool slots
        for i in range(len_q):
            t, visible = row + i, prefix_len + i + 1
            picks = torch.tensor([position[int(s)] for s in selection[t] if s >= 0])
            assert (selection[t][: picks.numel()] >= 0).all()  # best first: the unused picks come last
            # Selection: exactly min(topk, visible) causal picks, and they are the best-scoring keys.
            assert picks.numel() == min(topk, visible) and picks.max() < visible
            scores = (torch.relu(index_q[t] @ ikeys[:visible].T) * head_weights[t][:, None]).sum(0)
            assert scores[picks].min() >= scores.topk(picks.numel()).values.min() - 1e-6
            # Attention: dense softmax restricted to the picked keys.
            kk = keys[picks].repeat_interleave(hq // hkv, dim=1)
            vv = values[picks].repeat_interleave(hq // hkv, dim=1)
            probs = torch.softmax(torch.einsum("hd,khd->hk", q[t], kk) / d**0.5, dim=-1)
            assert (out[t] - torch.einsum("hk,khd->hd", probs, vv)).abs().max() <= TOL
        row += len_q


def test_picked_attention_masks_unused_picks():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen)
    is_valid = torch.tensor([[True, False, False], [True, True, True], [True, True, False]])
    k, v = torch.randn(3, 3, 2, 8, generator=gen), torch.randn(3, 3, 2, 8, generator=gen)
    k[~is_valid], v[~is_valid] = float("nan"), float("nan")  # an unused pick may point anywhere: never read
    out = picked_attention(q, is_valid, k, v, scale=0.5)
    for m in range(3):
        sel = is_valid[m]
        kk, vv = k[m][sel].repeat_interleave(2, dim=1), v[m][sel].repeat_interleave(2, dim=1)
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[m], kk) * 0.5, dim=-1)
        assert torch.allclose(out[m], torch.einsum("hk,khd->hd", probs, vv), atol=TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sparse_attention_flash_path_matches_the_reference_bf16(monkeypatch):
    config = get_preset("tiny-dsa")
    ctx = _dsa_context(config, [5, 40, 1], [0, 30, 9], 64, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(64, config.num_heads, config.head_dim, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(64, config.num_kv_heads, config.head_dim, generator=gen).cuda().bfloat16() for _ in range(2))
    index_q = torch.randn(64, config.index_n_heads, config.index_head_dim, generator=gen).cuda().bfloat16()
    index_k = torch.randn(64, config.index_head_dim, generator=gen).cuda().bfloat16()
    head_weights = torch.randn(64, config.index_n_heads, generator=gen).cuda().bfloat16()
    outs = []
    for is_flash in (True, False):
        monkeypatch.setattr(dsa_module, "is_varlen_usable", lambda q, flag=is_flash: flag)
        out = torch.full_like(q, float("nan"))
        with forward_context(ctx):
            selection = select_topk(index_q, index_k, head_weights, 0, config.index_topk)
            sparse_attention(q, k, v, pick_plan(selection, q), out, 0)
        outs.append(out.float())
    assert (outs[0] - outs[1]).abs().max() <= 2e-2
    assert (outs[0][ctx.num_tokens :] == 0).all()


@pytest.mark.parametrize("backend", ["eager", "breakable"])
def test_the_per_forward_memo_changes_no_answer(monkeypatch, backend):
    """Indexer key ranges and each selection's pick plan are worked out once per forward and reused by the layers that
    share them; with many indexer groups (freed selections could lend their address to later ones) the answers must
    equal those computed afresh in every layer."""
    from dataclasses import replace

    from bcg.ops.attention import BatchContext
    from bcg.runtime import Engine

    config = replace(get_preset("tiny-dsa"), num_layers=6, index_share=1)  # six groups, one layer each
    prompts = [list(range(1, 20)), list(range(30, 41))]
    options = dict(backend=backend, device="cpu", buckets=[32], chunked_prefill_size=32, kv_tokens=128,
                   progress=False)
    memoised = Engine(config, **options).prefill(prompts)
    monkeypatch.setattr(BatchContext, "memo", lambda self, key, make: make())
    afresh = Engine(config, **options).prefill(prompts)
    assert torch.equal(memoised.logits, afresh.logits)
