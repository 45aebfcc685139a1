"""Packed varlen batches and an independent per-sequence oracle in double precision, shared by the varlen attention
op's CPU tests and its Triton kernel's (interpreted on a CPU, compiled on CUDA)."""

from __future__ import annotations

import math

import torch

# name -> (query lengths, key lengths, features); key lengths beyond the query lengths are a cached prefix.
CASES = {
    "self": ([5, 1, 9], [5, 1, 9], {}),
    "prefixes": ([4, 1, 7], [7, 1, 17], {}),
    "empty-sequences": ([3, 0, 2, 0], [3, 0, 6, 0], {}),
    "one-query-each-and-an-empty-one": ([1, 1, 0], [1, 4, 0], {}),  # FlashAttention-2's one-query GQA reshape
    "more-queries-than-keys": ([4], [2], {}),  # the first rows see nothing: 0
    "long": ([70, 3], [150, 3], {}),  # several query and key blocks
    "window": ([6, 3, 40], [9, 3, 90], dict(window_left=2)),
    "softcap": ([6, 9], [10, 9], dict(softcap=0.7)),
    "sinks": ([5, 2, 0], [8, 2, 0], dict(sinks=True)),
    "scale": ([3, 2], [5, 2], dict(scale=0.3)),
    "gemma2-like": ([33, 7], [60, 7], dict(softcap=1.5, window_left=3, scale=12 ** -0.5)),
    "everything": ([17, 1, 5], [40, 9, 5], dict(softcap=2.0, window_left=6, scale=0.2, sinks=True)),
}


def packed(lens_q, lens_k, heads=4, kv_heads=2, dim=16, seed=0, extra_q=0, dtype=torch.bfloat16, device="cpu",
           sinks=False, **features):
    """``(q, k, v, cu_q, cu_k, features)``: random packed tensors (``extra_q`` rows after the last sequence)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q) + extra_q, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    if sinks:
        features["sinks"] = torch.randn(heads, generator=gen).to(device)
    return q, k, v, cu_q, cu_k, features


def oracle(q, k, v, lens_q, lens_k, scale=None, softcap=None, window_left=None, sinks=None) -> torch.Tensor:
    """Per sequence in double: query ``i`` sees key ``j`` iff ``i + Lk - Lq - window_left <= j <= i + Lk - Lq``;
    scores scaled, then soft-capped; sinks join the softmax with no value. Rows of no sequence are NaN."""
    out = torch.full(q.shape, math.nan, dtype=torch.float64)
    q0 = k0 = 0
    group = q.shape[1] // k.shape[1]
    for lq, lk in zip(lens_q, lens_k):
        qs = q[q0 : q0 + lq].double().cpu()
        ks = k[k0 : k0 + lk].double().cpu().repeat_interleave(group, 1)
        vs = v[k0 : k0 + lk].double().cpu().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None]
        seen = j <= i
        if window_left is not None:
            seen &= j >= i - window_left
        s = s.masked_fill(~seen, -math.inf)
        cols = [s]
        if sinks is not None:
            cols.append(sinks.double().cpu()[:, None, None].expand(-1, lq, 1))
        lse = torch.logsumexp(torch.cat(cols, -1), -1, keepdim=True)
        probs = torch.where(lse.isfinite(), torch.exp(s - lse), 0.0)
        out[q0 : q0 + lq] = torch.einsum("hqk,khd->qhd", probs, vs)
        q0, k0 = q0 + lq, k0 + lk
    return out


def pooled(k, v, unused=3, seed=0, slot_dtype=torch.int64):
    """``(pool_k, pool_v, kv_slots)``: the packed k/v scattered to shuffled rows of a larger pool whose other rows
    are NaN, the pool slot of each packed key, then ``unused`` slots naming a NaN row (a bucket's unused keys)."""
    total = k.shape[0]
    rows = total + 6
    perm = torch.randperm(rows - 1, generator=torch.Generator().manual_seed(seed))[:total].to(k.device)
    pool_k = torch.full((rows, *k.shape[1:]), math.nan, dtype=k.dtype, device=k.device)
    pool_v = torch.full((rows, *v.shape[1:]), math.nan, dtype=v.dtype, device=v.device)
    pool_k[perm], pool_v[perm] = k, v
    slots = torch.cat([perm, torch.full((unused,), rows - 1, device=k.device)]).to(slot_dtype)
    return pool_k, pool_v, slots


def runs_pooled(k, v, lens_k, seed=0):
    """``(pool_k, pool_v, kv_slots)`` as :func:`pooled`, but the keys of every other sequence (the first, third, ...)
    in one ascending run of pool rows (a gap of NaN rows before each run), the others' shuffled: a whole-step
    graph's batch of fresh prompts beside ones whose slots the pool handed out in pieces."""
    gen = torch.Generator().manual_seed(seed)
    rows, slots, k0 = 0, [], 0
    for i, n in enumerate(lens_k):
        block = torch.arange(rows + 2, rows + 2 + n)
        slots.append(block if i % 2 == 0 else block[torch.randperm(n, generator=gen)])
        rows, k0 = rows + 2 + n, k0 + n
    slots_t = torch.cat(slots).to(k.device)
    pool_k = torch.full((rows + 1, *k.shape[1:]), math.nan, dtype=k.dtype, device=k.device)
    pool_v = torch.full((rows + 1, *v.shape[1:]), math.nan, dtype=v.dtype, device=v.device)
    pool_k[slots_t], pool_v[slots_t] = k, v
    return pool_k, pool_v, slots_t
