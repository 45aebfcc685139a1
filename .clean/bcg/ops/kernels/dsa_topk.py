"""The DSA indexer's top-k: each query's best keys of its own request, as pool slots (one kernel on CUDA).

Query row ``i`` of request ``r`` sees the packed keys ``[cu_k[r], cu_k[r+1] - cu_q[r+1] + i]`` (its request's cached
prefix and new rows up to its own); key ``j`` is read from the pool at ``read_slots[j]``. Its score is ``sum_h w_ih *
relu(q_ih . k_j)`` in fp32; the row keeps its ``topk`` best keys, best first, ties to the earlier key (a stable
sort: the selection does not depend on how requests are packed), and returns their pool slots, ``-1`` for picks
past its range and on padded rows.

The plain-torch reference scores rows in chunks bounded by memory and sorts them: ten to twenty launches an island.
The Triton kernel (:mod:`bcg.ops.kernels.triton_dsa`) does it all in one launch while the longest key range fits
its sort (:data:`MAX_FUSED_KEYS`); longer ones take the reference, said once in the log. Neither reads a value back
to the host. Both are eager-only (the island's key ranges size them), so neither is a custom op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bcg.ops.kernels.dispatch import fused_available, use_fused

__all__ = ["MAX_FUSED_KEYS", "index_topk", "index_topk_reference", "key_range", "warm_index_topk"]

log = logging.getLogger(__name__)
Memo = Callable[[Any, Callable[[], Any]], Any]

# The longest key range the kernel sorts in registers (a power of two): 8192 int64 over 8 warps is 32 a thread.
MAX_FUSED_KEYS = 8192
# Bounds the reference's fp32 score tensor (rows x heads x packed keys) per chunk of query rows.
MAX_SCORES_PER_CHUNK = 1 << 25
# Bounds the kernel's int64 scratch (rows x sorted block) per launch.
MAX_SCRATCH = 1 << 22
_logged_long = False


def key_range(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """Per real row, the packed index of its request's first key and of its own key (int64 ``(num_tokens,)``)."""
    seq_lens_q = cu_seqlens_q.diff()
    first = torch.repeat_interleave(cu_seqlens_k[:-1].long(), seq_lens_q, output_size=num_tokens)
    own = torch.repeat_interleave((cu_seqlens_k[1:] - cu_seqlens_q[1:]).long(), seq_lens_q,
                                  output_size=num_tokens) + torch.arange(num_tokens, device=first.device)
    return first, own


def index_topk_reference(index_q: Tensor, head_weights: Tensor, keys: Tensor, read_slots: Tensor,
                         cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, num_tokens: int, topk: int,
                         memo: Memo | None = None) -> Tensor:
    """Plain torch (any device). ``memo(key, make)`` caches what every indexer of a forward shares (the key ranges
    and the masks they give), so only the first island makes them."""
    memo = memo or (lambda key, make: make())
    first, own = memo("dsa.key_range", lambda: key_range(cu_seqlens_q, cu_seqlens_k, num_tokens))
    packed = keys[read_slots].float()
    num_keys = packed.shape[0]
    num_picks = min(topk, num_keys)
    q, w = index_q.float(), head_weights.float()
    rows_per_chunk = max(1, MAX_SCORES_PER_CHUNK // (num_keys * q.shape[1]))
    picks = []
    for start in range(0, num_tokens, rows_per_chunk):  # bounded by memory, not by the number of requests
        rows = slice(start, min(num_tokens, start + rows_per_chunk))
        dots = torch.einsum("qhd,kd->qhk", q[rows], packed)
        scores = torch.bmm(w[rows][:, None, :], dots.relu_()).squeeze(1)
        scores.masked_fill_(memo(("dsa.hidden_keys", start, rows_per_chunk),
                                 lambda r=rows: _hidden_keys(first[r], own[r], num_keys)), float("-inf"))
        values, order = scores.sort(dim=-1, descending=True, stable=True)
        slots = read_slots[order[:, :num_picks]]
        picks.append(slots.masked_fill_(values[:, :num_picks] == float("-inf"), -1))
    picked = picks[0] if len(picks) == 1 else torch.cat(picks)
    missing = (0, topk - num_picks, 0, index_q.shape[0] - num_tokens)
    return torch.nn.functional.pad(picked, missing, value=-1) if any(missing) else picked


def _hidden_keys(first: Tensor, own: Tensor, num_keys: int) -> Tensor:
    """``(rows, num_keys)`` bool: the packed keys each row may not see (outside ``[first, own]``)."""
    cols = torch.arange(num_keys, device=first.device)
    return (cols < first[:, None]) | (cols > own[:, None])


def index_topk(index_q: Tensor, head_weights: Tensor, keys: Tensor, read_slots: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, num_tokens: int, max_seqlen_k: int, topk: int, impl: str = "fused",
               memo: Memo | None = None) -> Tensor:
    """Every query row's ``topk`` best keys as pool slots (see the module doc).

    Args:
        index_q: ``(T_pad, heads, head_dim)`` index queries (rows past ``num_tokens`` are padding).
        head_weights: ``(T_pad, heads)``.
        keys: ``(pool slots, head_dim)`` the index-key cache, this batch's keys already written.
        read_slots: int64 ``(sum of key ranges,)``: each request's key slots, packed like ``cu_seqlens_k``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(requests + 1,)`` cumulative new rows and key ranges.
        num_tokens: real rows; max_seqlen_k: the longest key range (sizes the kernel's sort).
        topk: picks per row.
        impl: ``"fused"`` (the kernel for CUDA tensors, the reference elsewhere) or ``"torch"``.
        memo: a per-forward cache for the reference (:func:`index_topk_reference`).

    Returns:
        int64 ``(T_pad, topk)`` pool slots, best first; ``-1`` for no pick.

    Example:
        >>> cu = torch.tensor([0, 3], dtype=torch.int32)
        >>> k = torch.tensor([[1.0], [3.0], [2.0]])
        >>> index_topk(torch.ones(4, 1, 1), torch.ones(4, 1), k, torch.arange(3), cu, cu, 3, 3, 2).tolist()
        [[0, -1], [1, 0], [1, 2], [-1, -1]]
    """
    fused = use_fused(impl, index_q)
    if not fused or max(max_seqlen_k, topk) > MAX_FUSED_KEYS:
        if fused:
            _log_long(max(max_seqlen_k, topk))
        return index_topk_reference(index_q, head_weights, keys, read_slots, cu_seqlens_q, cu_seqlens_k, num_tokens,
                                    topk, memo)
    from bcg.ops.kernels import triton_dsa

    if index_q.stride(-1) != 1 or keys.stride(-1) != 1 or head_weights.stride(-1) != 1:
        raise ValueError("index_q, head_weights and keys need a contiguous last dimension, got strides "
                         f"{index_q.stride()}, {head_weights.stride()}, {keys.stride()}")
    l_block = _sort_block(max_seqlen_k, topk)
    out = torch.empty((index_q.shape[0], topk), dtype=torch.int64, device=index_q.device)
    scratch = torch.empty((min(index_q.shape[0], max(1, MAX_SCRATCH // l_block)), l_block), dtype=torch.int64,
                          device=index_q.device)
    triton_dsa.index_topk(index_q, head_weights, keys, read_slots, cu_seqlens_q, cu_seqlens_k, num_tokens,
                          cu_seqlens_q.shape[0] - 1, l_block, out, scratch)
    return out


def _sort_block(max_seqlen_k: int, topk: int) -> int:
    """The kernel's sort width: a power of two holding the longest key range and ``topk`` (a compiled variant each)."""
    return 1 << (max(max_seqlen_k, topk, 16) - 1).bit_length()


def warm_index_topk(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, topk: int,
                    max_keys: int) -> list[int]:
    """Compiles the kernel for every sort width a batch of key ranges up to ``max_keys`` can need, on a one-row
    batch, so no request pays Triton's compile (seconds) in its latency. Returns the widths (none off CUDA)."""
    if not fused_available(device):
        return []
    from bcg.ops.kernels import triton_dsa

    widths, width = [], _sort_block(1, topk)
    while width <= min(_sort_block(max_keys, topk), MAX_FUSED_KEYS):
        widths.append(width)
        width *= 2
    floats, ints = dict(device=device, dtype=dtype), dict(device=device, dtype=torch.int64)
    q, w = torch.zeros(1, heads, head_dim, **floats), torch.zeros(1, heads, **floats)
    keys = torch.zeros(1, head_dim, **floats)
    slots, out = torch.zeros(1, **ints), torch.empty(1, topk, **ints)
    cu = torch.tensor([0, 1], device=device, dtype=torch.int32)
    for width in widths:
        scratch = torch.empty(1, width, **ints)
        triton_dsa.index_topk(q, w, keys, slots, cu, cu, 1, 1, width, out, scratch)
    return widths


def _log_long(size: int) -> None:
    global _logged_long
    if not _logged_long:
        _logged_long = True
        log.info("DSA indexer: a key range (or topk) of %d is more than the fused top-k sorts (%d), so such batches "
                 "run the plain-torch top-k (about fifteen launches an island instead of one)", size, MAX_FUSED_KEYS)
