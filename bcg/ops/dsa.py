"""The islands of DSA models: an indexer that picks each query's keys, and attention over only those keys.

Per token the indexer produces ``index_n_heads`` index queries and one index key (all of ``index_head_dim``) plus
one weight per head. The score of query ``i`` for key ``j`` is ``sum_h w_ih * relu(q_ih . k_j)``, causal within a
request (cached prefix included). Each query keeps its ``index_topk`` best keys; ties go to the earlier key (stable
sort), so the selection does not depend on how requests are packed.

Both steps are eager islands because both read the live batch. The sparse attention is also genuinely
uncapturable: it compacts the valid (query, key) pairs with ``nonzero`` (a data-dependent count), then runs a
segment softmax over the pairs of each query: FlashAttention varlen on CUDA in half precision (each query's pairs
form one sequence), explicit segment reductions elsewhere (the exact reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg import eager_on_graph
from bcg.ops.attention import BatchContext, write_and_gather_kv
from bcg.ops.context import get_forward_context
from bcg.ops.flash import flash_varlen, is_varlen_usable

__all__ = ["UNCAPTURABLE", "segment_attention", "select_topk", "sparse_attention"]

# Bounds the memory of the pair tensors in sparse attention (each is pairs x num_heads x head_dim).
MAX_PAIRS_PER_CHUNK = 1 << 18
# Bounds the indexer's fp32 score tensor (rows x heads x packed keys) per chunk of query rows.
MAX_SCORES_PER_CHUNK = 1 << 25
# Why neither island fits a whole-layer-stack graph (raised when one meets the "full" backend's static context).
UNCAPTURABLE = ("the DSA indexer select_topk sizes its scores by the live batch's packed key ranges, and "
                "sparse_attention compacts the selected (query, key) pairs with nonzero, whose output shape depends "
                "on the data")


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
    cache.index_copy_(0, ctx.write_slots, index_k[:num_tokens])
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
        layer_id: which layer's KV cache to use (real rows' K/V are written there first).
    """
    ctx: BatchContext = get_forward_context().live("bcg.ops.dsa.sparse_attention", UNCAPTURABLE)
    num_tokens = ctx.num_tokens
    keys, values = write_and_gather_kv(ctx, layer_id, k, v)
    # Offset of each query's request in the packed keys, so a position maps to a packed row.
    key_starts = torch.repeat_interleave(
        ctx.cu_seqlens_k[:-1].long(), ctx.cu_seqlens_q.diff(), output_size=num_tokens
    )
    topk = selection.shape[1]
    rows_per_chunk = max(1, MAX_PAIRS_PER_CHUNK // topk)
    for start in range(0, num_tokens, rows_per_chunk):
        stop = min(num_tokens, start + rows_per_chunk)
        picks = selection[start:stop]
        is_valid = picks >= 0
        # The uncapturable step: how many pairs survive depends on the data. nonzero yields them
        # in row-major order, i.e. grouped by query row as segment_attention wants.
        rows, cols = is_valid.nonzero(as_tuple=True)
        key_rows = key_starts[start:stop][rows] + picks[rows, cols]
        out[start:stop] = _attend_pairs(q[start:stop], rows, is_valid.sum(1), keys[key_rows], values[key_rows], topk)
    out[num_tokens:].zero_()


def _attend_pairs(
    q: Tensor, rows: Tensor, lengths: Tensor, k_pairs: Tensor, v_pairs: Tensor, max_pairs_per_row: int
) -> Tensor:
    """Each query row attends over its run of compacted pairs.

    On CUDA in half precision the runs are exactly a varlen batch (one query per sequence, the
    row's pairs as its keys), so FlashAttention does the segment softmax without materialising
    per-pair products; elsewhere :func:`segment_attention` computes the same thing explicitly.
    """
    if not is_varlen_usable(q):
        return segment_attention(q, rows, lengths, k_pairs, v_pairs, q.shape[-1] ** -0.5)
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    cu_seqlens_k = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    # An upper bound on the longest run (no host read of lengths.max()) is enough for max_seqlen_k.
    return flash_varlen(q, k_pairs, v_pairs, cu_seqlens_q, cu_seqlens_k, 1, max_pairs_per_row, is_causal=False)


def segment_attention(q: Tensor, rows: Tensor, lengths: Tensor, k_pairs: Tensor, v_pairs: Tensor,
                      scale: float) -> Tensor:
    """Attention over a list of (query row, key) pairs, softmax taken per query row.

    Args:
        q: ``(M, num_heads, head_dim)`` queries.
        rows: ``(P,)`` query row of each pair, ascending (pairs grouped by row).
        lengths: ``(M,)`` pairs per row; every row needs at least one.
        k_pairs, v_pairs: ``(P, num_kv_heads, head_dim)`` key/value of each pair.
        scale: score scale.

    Returns:
        ``(M, num_heads, head_dim)`` in ``q.dtype``; scores are summed and the softmax and the
        weighted sum are computed in fp32.

    Segment reductions (not ``index_add_``, whose float atomics on GPU sum in a varying order)
    keep the result bit-identical from run to run, so graph replay can be checked against eager.

    Example:
        >>> q, kv = torch.randn(2, 2, 4), torch.randn(3, 1, 4)
        >>> segment_attention(q, torch.tensor([0, 1, 1]), torch.tensor([1, 2]), kv, kv, 0.5).shape
        torch.Size([2, 2, 4])
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_pairs.shape[1]
    group = num_heads // num_kv_heads
    q_pairs = q.view(num_rows, num_kv_heads, group, head_dim)[rows]
    # Elementwise product + fp32 sum rather than einsum (which would become a batched matmul of
    # P * num_kv_heads tiny products, far slower); no fp32 copies of the pair tensors, which are
    # the bulk of this island's memory traffic.
    scores = (q_pairs * k_pairs[:, :, None, :]).sum(-1, dtype=torch.float32).flatten(1) * scale
    row_max = torch.segment_reduce(scores, "max", lengths=lengths, unsafe=True)
    probs = (scores - row_max[rows]).exp_()
    denom = torch.segment_reduce(probs, "sum", lengths=lengths, unsafe=True)
    weighted = probs.view(-1, num_kv_heads, group, 1) * v_pairs[:, :, None, :]  # promotes to fp32
    acc = torch.segment_reduce(weighted, "sum", lengths=lengths, unsafe=True)
    return (acc.view(num_rows, num_heads, head_dim) / denom[..., None]).to(q.dtype)
