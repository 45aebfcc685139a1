"""The islands of DSA models: an indexer that picks each query's keys, and attention over only those keys.

Per token the indexer produces ``index_n_heads`` index queries and one index key (all of ``index_head_dim``) plus
one weight per head. The score of query ``i`` for key ``j`` is ``sum_h w_ih * relu(q_ih . k_j)``, causal within a
request (cached prefix included). Each query keeps its ``index_topk`` best keys; ties go to the earlier key (stable
sort), so the selection does not depend on how requests are packed.

Both steps are eager islands because both read the live batch (its key ranges size their work). Neither reads a
value back to the host, so a replay never drains the GPU at a DSA layer: the sparse attention handles each query's
``index_topk`` picks at a fixed size, unused picks masked (FlashAttention varlen over the valid picks, packed on
the device, on CUDA in half precision; an explicit masked softmax elsewhere, the exact reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg import eager_on_graph
from bcg.ops.attention import BatchContext
from bcg.ops.context import get_forward_context
from bcg.ops.flash import flash_varlen, is_varlen_usable

__all__ = ["UNCAPTURABLE", "picked_attention", "select_topk", "sparse_attention"]

# Bounds the memory of the pair tensors in sparse attention (each is pairs x num_heads x head_dim).
MAX_PAIRS_PER_CHUNK = 1 << 18
# Bounds the indexer's fp32 score tensor (rows x heads x packed keys) per chunk of query rows.
MAX_SCORES_PER_CHUNK = 1 << 25
# Why neither island fits a whole-layer-stack graph (raised when one meets the "full" backend's static context).
UNCAPTURABLE = ("the DSA indexer select_topk sizes its scores by the live batch's packed key ranges, and "
                "sparse_attention gathers the selected keys from those ranges")


@eager_on_graph
def select_topk(index_q: Tensor, index_k: Tensor, head_weights: Tensor, group_id: int, topk: int) -> Tensor:
    """Indexer island: cache the real tokens' index keys and pick each query's top keys.

    Args:
        index_q: ``(T_pad, index_n_heads, index_head_dim)``.
        index_k: ``(T_pad, index_head_dim)``.
        head_weights: ``(T_pad, index_n_heads)``.
        group_id: indexer group, i.e. which index-key cache of the pool to use.
        topk: keys kept per query.

    Returns:
        int64 ``(T_pad, topk)``: per query, the positions (within its request, prefix included)
        of the selected keys, best first; ``-1`` marks unused picks and fills padded rows.
    """
    ctx: BatchContext = get_forward_context().live("bcg.ops.dsa.select_topk", UNCAPTURABLE)
    num_tokens, device = ctx.num_tokens, index_q.device
    cache = ctx.kv_pool.index_k[group_id]
    cache.index_copy_(0, ctx.write_slots, index_k)  # every row: padded ones write the scratch slot
    # fp32 so the ranking does not hinge on bf16 rounding. Keys are every request's range, packed.
    keys = (cache[ctx.read_slots] if ctx.has_prefix else index_k[:num_tokens]).float()
    num_keys = keys.shape[0]
    # All requests at once (no host loop per request): query row i of request r sees the packed keys
    # [cu_k[r], cu_k[r+1] - cu_q[r+1] + i], i.e. its own range up to its own position.
    seq_lens_q = ctx.cu_seqlens_q.diff()
    first = torch.repeat_interleave(ctx.cu_seqlens_k[:-1].long(), seq_lens_q, output_size=num_tokens)
    last = torch.repeat_interleave((ctx.cu_seqlens_k[1:] - ctx.cu_seqlens_q[1:]).long(), seq_lens_q,
                                   output_size=num_tokens) + torch.arange(num_tokens, device=device)
    cols = torch.arange(num_keys, device=device)
    selection = torch.full((ctx.num_padded_tokens, topk), -1, dtype=torch.int64, device=device)
    num_picks = min(topk, num_keys)
    rows_per_chunk = max(1, MAX_SCORES_PER_CHUNK // (num_keys * index_q.shape[1]))
    for start in range(0, num_tokens, rows_per_chunk):  # bounded by memory, not by the number of requests
        rows = slice(start, min(num_tokens, start + rows_per_chunk))
        dots = torch.einsum("qhd,kd->qhk", index_q[rows].float(), keys)
        scores = torch.bmm(head_weights[rows].float()[:, None, :], dots.relu_()).squeeze(1)
        is_visible = (cols >= first[rows, None]) & (cols <= last[rows, None])
        scores.masked_fill_(~is_visible, float("-inf"))
        values, picks = scores.sort(dim=-1, descending=True, stable=True)
        values, picks = values[:, :num_picks], picks[:, :num_picks]
        selection[rows, :num_picks] = (picks - first[rows, None]).masked_fill(values == float("-inf"), -1)
    return selection


@eager_on_graph
def sparse_attention(q: Tensor, k: Tensor, v: Tensor, selection: Tensor, out: Tensor, layer_id: int) -> None:
    """Sparse attention island: each real query attends only to its selected keys.

    Args:
        q: ``(T_pad, num_heads, head_dim)``; k, v: ``(T_pad, num_kv_heads, head_dim)``.
        selection: ``(T_pad, topk)`` from :func:`select_topk`.
        out: ``(T_pad, num_heads, head_dim)``; real rows get the result, padded rows zeros.
        layer_id: which layer's KV cache to use (every row's K/V is written there first).

    Nothing here reads a value back to the host: every shape follows from the batch's host ints and ``topk``, so
    the host keeps launching the next segment while the GPU works.
    """
    ctx: BatchContext = get_forward_context().live("bcg.ops.dsa.sparse_attention", UNCAPTURABLE)
    num_tokens = ctx.num_tokens
    ctx.store_kv(layer_id, k, v)
    keys, values = ctx.keys_values(layer_id, k, v)
    # Offset of each query's request in the packed keys, so a position maps to a packed row.
    key_starts = torch.repeat_interleave(
        ctx.cu_seqlens_k[:-1].long(), ctx.cu_seqlens_q.diff(), output_size=num_tokens
    )
    topk = selection.shape[1]
    rows_per_chunk = max(1, MAX_PAIRS_PER_CHUNK // topk)
    for start in range(0, num_tokens, rows_per_chunk):
        stop = min(num_tokens, start + rows_per_chunk)
        picks = selection[start:stop]
        key_rows = key_starts[start:stop, None] + picks.clamp_min(0)  # unused picks point at a valid key, masked
        out[start:stop] = _attend_picks(q[start:stop], picks >= 0, key_rows, keys, values)
    if num_tokens < out.shape[0]:
        out[num_tokens:].zero_()


def _attend_picks(q: Tensor, is_valid: Tensor, key_rows: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Each query row attends over its valid picks (``is_valid``/``key_rows``: ``(M, topk)``); fixed shapes.

    :func:`select_topk` sorts each row's picks best first, so a row's valid picks are a prefix of it. On CUDA in half
    precision they are packed row after row (a scatter to positions from a device-side prefix sum, no host read of
    how many there are) and FlashAttention varlen does the softmax with each row as one sequence; elsewhere
    :func:`picked_attention` computes the same thing over the ``(M, topk)`` picks with the unused ones masked.
    """
    if not is_varlen_usable(q):
        return picked_attention(q, is_valid, keys[key_rows], values[key_rows], q.shape[-1] ** -0.5)
    num_rows, topk = is_valid.shape
    lengths = is_valid.sum(1, dtype=torch.int32)
    cu_seqlens_k = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    # Pair (i, j) goes to cu_seqlens_k[i] + j; unused pairs go to a dump slot past the end.
    dest = cu_seqlens_k[:-1, None].long() + torch.arange(topk, device=q.device)
    dest = torch.where(is_valid, dest, num_rows * topk)
    packed = torch.zeros(num_rows * topk + 1, dtype=torch.int64, device=q.device)
    packed.scatter_(0, dest.flatten(), key_rows.flatten())
    packed = packed[:-1]
    cu_seqlens_q = torch.arange(num_rows + 1, dtype=torch.int32, device=q.device)
    return flash_varlen(q, keys[packed], values[packed], cu_seqlens_q, cu_seqlens_k, 1, topk, is_causal=False)


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
