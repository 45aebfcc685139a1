"""DSA attention with one island per indexer group: the FlashAttention layout of the picks against the reference,
and how many islands (and ops in each) a forward runs eagerly."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from bcg.bench.trace import island_label, kernels_from_events
from bcg.islands import observing_islands
from bcg.models.config import get_preset
from bcg.ops import dsa as dsa_module
from bcg.ops.context import forward_context
from bcg.ops.dsa import pick_plan, select_topk, sparse_attention
from bcg.runtime import Engine
from tests.ops.test_dsa import _dsa_context

# Ops a CPU profile shows in one indexer island (scores, mask, sort, slots): einsum and sort count their inner copies.
# Today's code has 11; the first island of a forward also makes the forward's key ranges (14 more). Before the
# sparse attention left the islands, every layer ran one of 16 ops and the indexer islands 15 (29 the first).
MAX_ISLAND_OPS, MAX_FIRST_EXTRA = 12, 14


def _varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, *, is_causal: bool, out: Tensor | None = None) -> Tensor:
    """What ``flash_varlen`` computes (non-causal here) in fp32, with fixed shapes and no host read, so a graph can
    capture it as it captures the kernel: every query row against every key row, masked to its sequence's keys. A
    sequence without keys gets NaN (the kernel may leave such rows unwritten)."""
    assert not is_causal and out is None
    rows, keys = torch.arange(q.shape[0]), torch.arange(k.shape[0])
    seq = torch.searchsorted(cu_seqlens_q, rows, right=True) - 1  # each query row's sequence
    first, stop = cu_seqlens_k[seq].long(), cu_seqlens_k[seq + 1].long()
    visible = (keys >= first[:, None]) & (keys < stop[:, None])
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1).float() for t in (k, v))
    scores = torch.einsum("qhd,khd->qhk", q.float(), kk) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("qhk,khd->qhd", probs, vv).to(q.dtype)


@pytest.mark.parametrize("rows_per_chunk", [24, 5])  # one chunk; five rows a chunk, the last one short
def test_flash_layout_of_the_picks_matches_the_reference(monkeypatch, rows_per_chunk):
    config = get_preset("tiny-dsa")
    ctx = _dsa_context(config, [5, 12, 1], [0, 6, 9], 24)
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = (torch.randn(24, h, d, generator=gen) for h in (hq, hkv, hkv))
    index = (torch.randn(24, config.index_n_heads, config.index_head_dim, generator=gen),
             torch.randn(24, config.index_head_dim, generator=gen),
             torch.randn(24, config.index_n_heads, generator=gen))
    outs = []
    for is_flash in (False, True):
        monkeypatch.setattr(dsa_module, "is_varlen_usable", lambda q, flag=is_flash: flag)
        monkeypatch.setattr(dsa_module, "flash_varlen", _varlen_reference)
        monkeypatch.setattr(dsa_module, "MAX_PAIRS_PER_CHUNK", rows_per_chunk * config.index_topk)
        out = torch.full_like(q, float("nan"))
        with forward_context(ctx):
            plan = pick_plan(select_topk(*index, 0, config.index_topk), q)
            sparse_attention(q, k, v, plan, out, 0)
        outs.append(out)
    assert len(plan) == 4 and plan[2].shape == (-(-24 // rows_per_chunk), rows_per_chunk + 1)
    assert torch.allclose(outs[0], outs[1], atol=1e-5) and (outs[1][ctx.num_tokens :] == 0).all()


def _island_ops(eng: Engine, prompts: list[list[int]]) -> tuple[list[str], dict[str, int]]:
    """The islands one prefill calls, in order, and the ops a CPU profile attributes to each call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    names: list[str] = []

    def call(fn, name, args, kwargs):
        with record_function(island_label(name, len(names))):
            names.append(name)
            return fn(*args, **kwargs)

    eng.prefill(prompts)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof, observing_islands(call):
        eng.prefill(prompts)
    kernels = kernels_from_events(prof.events(), cuda=False).kernels
    return names, dict(Counter(k.island for k in kernels if k.island is not None))


def test_a_forward_runs_one_lean_island_per_indexer_group():
    config = replace(get_preset("tiny-dsa"), num_layers=8, index_share=4)
    eng = Engine(config, backend="eager", device="cpu", buckets=[64], chunked_prefill_size=64, kv_tokens=512,
                 progress=False)
    names, ops = _island_ops(eng, [list(range(1, 41)), list(range(50, 60))])
    assert names == ["select_topk"] * config.num_index_groups  # the sparse attention is no island
    counts = [ops.get(f"{name}#{i}", 0) for i, name in enumerate(names)]
    assert 0 < counts[0] <= MAX_ISLAND_OPS + MAX_FIRST_EXTRA and all(0 < c <= MAX_ISLAND_OPS for c in counts[1:])


def test_a_breakable_graph_breaks_once_per_indexer_group():
    config = replace(get_preset("tiny-dsa"), num_layers=6, index_share=3)
    eng = Engine(config, backend="breakable", device="cpu", buckets=[16], chunked_prefill_size=16, kv_tokens=256,
                 progress=False)
    record = eng.telemetry.buckets[16]
    assert (record.num_segments, record.num_breaks) == (config.num_index_groups + 1, config.num_index_groups)
    prompts = [list(range(1, 12)), list(range(20, 24))]
    eager = Engine(config, backend="eager", device="cpu", buckets=[16], chunked_prefill_size=16, kv_tokens=256,
                   progress=False)
    # (Not bit for bit: the graph runs 16 rows, eager 15, and a matmul may round differently at another row count.)
    assert (eng.prefill(prompts).logits - eager.prefill(prompts).logits).abs().max() <= 1e-5


def test_a_breakable_graph_with_the_flash_layout_matches_the_reference(monkeypatch):
    """The FlashAttention layout captured in the segments (here with a CPU stand-in for the kernel, chunks of three
    rows) replays batches with prefixes and padding as the reference path computes them eagerly."""
    config = replace(get_preset("tiny-dsa"), num_layers=4, index_share=2)
    options = dict(device="cpu", buckets=[16], chunked_prefill_size=16, kv_tokens=256, progress=False)
    batches = [[list(range(1, 12)), list(range(20, 24))], [list(range(40, 70))], [[5], list(range(80, 93))]]
    expected = [Engine(config, backend="eager", **options).prefill(b).logits for b in batches]
    monkeypatch.setattr(dsa_module, "is_varlen_usable", lambda q: True)
    monkeypatch.setattr(dsa_module, "flash_varlen", _varlen_reference)
    monkeypatch.setattr(dsa_module, "MAX_PAIRS_PER_CHUNK", 3 * config.index_topk)
    eng = Engine(config, backend="breakable", **options)
    for batch, want in zip(batches, expected):
        res = eng.prefill(batch)
        assert all(b.graph_used for b in res.batches) and (res.logits - want).abs().max() <= 1e-5
