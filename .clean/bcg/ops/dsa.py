"""DSA models' attention: an indexer island that picks each query's keys, and attention over only those keys.

Per token the indexer produces ``index_n_heads`` index queries and one index key (all of ``index_head_dim``) plus
one weight per head. The score of query ``i`` for key ``j`` is ``sum_h w_ih * relu(q_ih . k_j)``, causal within a
request (cached prefix included). Each query keeps its ``index_topk`` best keys; ties go to the earlier key (stable
sort), so the selection does not depend on how requests are packed.

Only the scores and the top-k are an island (:func:`select_topk`): they read the live batch, whose key ranges size
them. Everything else has fixed shapes per bucket and is captured in the graph segments: the index keys' write into
the pool before the island; after it, once per indexer group, the pick plan (:func:`pick_plan`: which pool rows each
query attends, laid out for the kernel), and in every layer the K/V write, the gather of the picked keys and values
from the pool, and the attention over them (:func:`sparse_attention`: FlashAttention varlen with one query a
sequence, on CUDA in half precision; elsewhere an explicit masked softmax, the exact reference). A forward thus
breaks once per indexer group, not once per layer, and nothing reads a value back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg import eager_on_graph
from bcg.ops.attention import BatchContext
from bcg.ops.context import get_forward_context
from bcg.ops.flash import flash_varlen, is_varlen_usable
from bcg.ops.kernels.dispatch import use_fused
from bcg.ops.kernels.dsa_topk import index_topk

__all__ = ["UNCAPTURABLE", "pick_plan", "picked_attention", "select_topk", "sparse_attention", "topk_island"]

# Bounds the memory of the gathered keys and values (each is pairs x num_kv_heads x head_dim), per chunk of rows.
MAX_PAIRS_PER_CHUNK = 1 << 16
# Why the indexer island does not fit a whole-layer-stack graph (raised when it meets the "full" backend's context).
UNCAPTURABLE = ("the DSA indexer select_topk sizes its scores by the live batch's packed key ranges, and "
                "sparse_attention gathers the selected keys from those ranges")


def select_topk(index_q: Tensor, index_k: Tensor, head_weights: Tensor, group_id: int, topk: int,
                impl: str = "torch") -> Tensor:
    """The indexer: caches every row's index key (in the segment), then picks each query's top keys (the island).

    Args:
        index_q: ``(T_pad, index_n_heads, index_head_dim)``.
        index_k: ``(T_pad, index_head_dim)``.
        head_weights: ``(T_pad, index_n_heads)``.
        group_id: indexer group, i.e. which index-key cache of the pool to use.
        topk: keys kept per query.
        impl: the top-k's kernels (:func:`bcg.ops.kernels.dsa_topk.index_topk`): ``"fused"`` or ``"torch"``.

    Returns:
        int64 ``(T_pad, topk)``: per query, the pool slots of the selected keys, best first; ``-1`` marks unused
        picks and fills padded rows.
    """
    ctx = get_forward_context()
    ctx.kv_pool.index_k[group_id].index_copy_(0, ctx.write_slots, index_k)  # padded rows write the scratch slot
    if not use_fused(impl, index_q):  # the reference ranks in fp32: cast here, where a graph captures it
        index_q, head_weights = index_q.float(), head_weights.float()
    return topk_island(index_q, head_weights, group_id, topk, ctx.write_slots, impl)


def _topk_island(index_q: Tensor, head_weights: Tensor, group_id: int, topk: int, write_slots: Tensor | None = None,
                 impl: str = "torch") -> Tensor:
    """The island of :func:`select_topk` (same arguments; the index keys already cached): each real row's scores
    against every key of its request, top-k, pool slots; padded rows and missing picks ``-1``.

    ``write_slots`` are the slots the index-key write before it used: at replay, the ones the graph captured."""
    ctx: BatchContext = get_forward_context().live("bcg.ops.dsa.select_topk", UNCAPTURABLE)
    if write_slots is not None and ctx.write_slots.data_ptr() != write_slots.data_ptr():
        raise RuntimeError(
            "the forward context's write slots are not the ones this graph was captured with, so the captured index-"
            "key and K/V writes stored this batch at another batch's slots. Load every batch of a graph into the "
            "fields it was captured against (one Layout of a MetadataArena), not into fresh ones")
    # ctx.memo: what the reference shares between the forward's indexers is made by the first, reused by the others
    return index_topk(index_q, head_weights, ctx.kv_pool.index_k[group_id], ctx.read_slots, ctx.cu_seqlens_q,
                      ctx.cu_seqlens_k, ctx.num_tokens, ctx.max_seqlen_k, topk, impl, ctx.memo)


# The island keeps the indexer's name: profiles, forecasts and refusals call it select_topk.
_topk_island.__qualname__ = "select_topk"
topk_island = eager_on_graph(_topk_island)


def pick_plan(selection: Tensor, q: Tensor) -> list[Tensor]:
    """How every row attends its picks, from :func:`select_topk`'s ``(T_pad, topk)`` slots; fixed shapes, made once
    per indexer group in the graph segment and read by every layer of the group (:func:`sparse_attention`).

    The rows go in chunks of ``R`` (``MAX_PAIRS_PER_CHUNK // topk``, at most ``T_pad``). For the reference:
    ``[has_picks, slots (T_pad, topk) with unused picks at slot 0, is_valid]``. On CUDA in half precision, for
    FlashAttention varlen with one query a sequence: ``[has_picks, packed slots (C * R * topk,), cu_seqlens_k (C, R +
    1), cu_seqlens_q (R + 1,)]``: chunk ``c``'s valid picks are packed row after row from ``c * R * topk`` (a row's
    valid picks are a prefix of it, best first; they go to positions from a device-side prefix sum, no host read).

    Example:
        >>> plan = pick_plan(torch.tensor([[5, 2], [7, -1], [-1, -1]]), torch.zeros(3, 1, 4))
        >>> [t.tolist() for t in plan]
        [[True, True, False], [[5, 2], [7, 0], [0, 0]], [[True, True], [True, False], [False, False]]]
    """
    is_valid = selection >= 0
    has_picks = is_valid[:, 0]  # best first: a row with any pick has its first
    if not is_varlen_usable(q):
        return [has_picks, selection.clamp_min(0), is_valid]
    num_rows, topk = selection.shape
    chunk = min(num_rows, max(1, MAX_PAIRS_PER_CHUNK // topk))
    num_chunks = -(-num_rows // chunk)
    lengths = F.pad(is_valid.sum(1, dtype=torch.int32), (0, num_chunks * chunk - num_rows)).view(num_chunks, chunk)
    cu_seqlens_k = F.pad(lengths.cumsum(1, dtype=torch.int32), (1, 0))
    # Pair (i, j) of chunk c goes to c * R * topk + cu_seqlens_k[c, i] + j; unused pairs to a dump slot at the end.
    base = torch.arange(num_chunks, device=q.device)[:, None] * (chunk * topk) + cu_seqlens_k[:, :-1]
    dest = base.flatten()[:num_rows, None] + torch.arange(topk, device=q.device)
    dest = torch.where(is_valid, dest, num_chunks * chunk * topk)
    packed = torch.zeros(num_chunks * chunk * topk + 1, dtype=torch.int64, device=q.device)
    packed.scatter_(0, dest.flatten(), selection.flatten())
    cu_seqlens_q = torch.arange(chunk + 1, dtype=torch.int32, device=q.device)
    return [has_picks, packed[:-1], cu_seqlens_k, cu_seqlens_q]


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: list[Tensor], out: Tensor, layer_id: int) -> None:
    """Each real query attends only to its selected keys; fixed shapes only, so a graph segment captures it.

    Args:
        q: ``(T_pad, num_heads, head_dim)``; k, v: ``(T_pad, num_kv_heads, head_dim)``.
        plan: :func:`pick_plan` of the layer's indexer group.
        out: ``(T_pad, num_heads, head_dim)``; real rows get the result, padded rows zeros.
        layer_id: which layer's KV cache to use (every row's K/V is written there first, then read back by slot).
    """
    ctx = get_forward_context()
    ctx.store_kv(layer_id, k, v)
    keys, values = ctx.kv_pool.k[layer_id], ctx.kv_pool.v[layer_id]
    has_picks, num_rows = plan[0], q.shape[0]
    if len(plan) == 3:
        slots, is_valid = plan[1], plan[2]
        chunk = max(1, MAX_PAIRS_PER_CHUNK // slots.shape[1])
        for a in range(0, num_rows, chunk):
            r = slice(a, min(num_rows, a + chunk))
            result = picked_attention(q[r], is_valid[r], keys[slots[r]], values[slots[r]], q.shape[-1] ** -0.5)
            # where, not a multiply: a row with no pick (a padded one) softmaxes only -inf, i.e. NaN.
            out[r] = torch.where(has_picks[r, None, None], result, 0.0)
        return
    packed, cu_seqlens_k, cu_seqlens_q = plan[1], plan[2], plan[3]
    chunk = cu_seqlens_q.shape[0] - 1
    topk = packed.shape[0] // (chunk * cu_seqlens_k.shape[0])
    for c, a in enumerate(range(0, num_rows, chunk)):
        r = slice(a, min(num_rows, a + chunk))
        pairs = packed[c * chunk * topk : (c + 1) * chunk * topk]
        m = r.stop - r.start
        result = flash_varlen(q[r], keys[pairs], values[pairs], cu_seqlens_q[: m + 1], cu_seqlens_k[c, : m + 1], 1,
                              topk, is_causal=False)
        out[r] = torch.where(has_picks[r, None, None], result, 0.0)  # a row with no pick: whatever the kernel left


def picked_attention(q: Tensor, is_valid: Tensor, k_picks: Tensor, v_picks: Tensor, scale: float) -> Tensor:
    """Attention of each query row over its own ``topk`` picked keys, unused picks masked; the exact reference.

    Args:
        q: ``(M, num_heads, head_dim)`` queries.
        is_valid: ``(M, topk)`` bool; every row needs at least one valid pick.
        k_picks, v_picks: ``(M, topk, num_kv_heads, head_dim)`` the picked keys/values.
        scale: score scale.

    Returns:
        ``(M, num_heads, head_dim)`` in ``q.dtype``; scores, softmax and the weighted sum in fp32. No atomics,
        so the result is the same from run to run (graph replay is checked against eager bit for bit).

    Example:
        >>> q, kv = torch.randn(2, 2, 4), torch.randn(2, 3, 1, 4)
        >>> picked_attention(q, torch.tensor([[True, False, False], [True, True, False]]), kv, kv, 0.5).shape
        torch.Size([2, 2, 4])
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_picks.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(num_rows, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("mhgd,mthd->mhgt", qg, k_picks.float()) * scale
    scores.masked_fill_(~is_valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    # An unused pick's value is weighted 0, and 0 * NaN is NaN: whatever it points at must not reach the row.
    v_picks = torch.where(is_valid[:, :, None, None], v_picks.float(), 0.0)
    out = torch.einsum("mhgt,mthd->mhgd", probs, v_picks)
    return out.reshape(num_rows, num_heads, head_dim).to(q.dtype)
