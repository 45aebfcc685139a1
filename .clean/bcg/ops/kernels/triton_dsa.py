"""Triton kernel behind :mod:`bcg.ops.kernels.dsa_topk`: the DSA indexer's scores and top-k in one launch.

One program per query row. It finds its request (how many requests end at or before the row), so its visible keys
are the packed range ``[cu_k[r], cu_k[r + 1] - cu_q[r + 1] + row]``; it scores them in blocks of ``BLOCK_K``
(``sum_h w_h * relu(q_h . k)`` in fp32, the keys read from the pool through ``read_slots``), writes each score with
its key's position as one int64 into a scratch row, then sorts the row (a bitonic sort in registers) and writes the
best ``TOPK`` keys' pool slots, ``-1`` past the row's range and on padded rows.

The int64 is ``(ordered(score) << 32) | (2**32 - 1 - j)``: ``ordered`` maps fp32 bits to an int32 with the order of
the floats (negatives' magnitude bits flipped; -0.0 is made +0.0 first), so sorting the int64 descending ranks by
score and, among equal scores, the earlier key first: the stable sort of the reference, with no two keys equal.
Positions past the range hold INT64_MIN, below every real key, so they sort last. Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import grid_dependency, launch

# Globals a compiled kernel reads must be constexpr.
_LOW = tl.constexpr(4294967295)  # 2**32 - 1: the key's position in the low 32 bits, reversed: the earlier key is larger
_NEG_INF_ORDERED = tl.constexpr(-2139095041)  # ordered(-inf): fp32 bits 0xFF800000 with the magnitude bits flipped
_INT64_MIN = tl.constexpr(-9223372036854775808)


# Triton compiles a variant per value class of every int and pointer argument (equal to 1, divisible by 16): the
# batch's sizes and the metadata views change from call to call, so they are not specialised, and the build's
# warm-up (one variant per sort width) is all a served batch needs. The row strides of the pool and of a query's
# heads are fixed by the model, so they are constants of the variant.
@triton.jit(do_not_specialize=["q_row_stride", "w_row_stride", "read_slots_ptr", "cu_q_ptr", "cu_k_ptr",
                               "num_tokens", "num_requests", "row0"])
def _index_topk_kernel(
    q_ptr, q_row_stride, w_ptr, w_row_stride, keys_ptr, read_slots_ptr, cu_q_ptr, cu_k_ptr, scratch_ptr, out_ptr,
    num_tokens, num_requests, row0,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, Q_HEAD_STRIDE: tl.constexpr,
    KEY_STRIDE: tl.constexpr, TOPK: tl.constexpr, L_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    R_BLOCK: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    pid = tl.program_id(0).to(tl.int64)
    row = row0 + pid
    # The row's request: the number of requests whose rows end at or before it (padded rows: the last, length 0).
    req = tl.full([], 0, tl.int32)
    for r0 in range(0, num_requests, R_BLOCK):
        r = r0 + tl.arange(0, R_BLOCK)
        ends = tl.load(cu_q_ptr + 1 + r, mask=r < num_requests, other=num_tokens + 1).to(tl.int64)
        req += tl.sum((ends <= row).to(tl.int32), axis=0)
    req = tl.minimum(req, num_requests - 1)
    first = tl.load(cu_k_ptr + req).to(tl.int64)
    own = tl.load(cu_k_ptr + req + 1).to(tl.int64) - tl.load(cu_q_ptr + req + 1).to(tl.int64) + row
    length = tl.where(row < num_tokens, own - first + 1, 0)

    d = tl.arange(0, D_BLOCK)
    d_ok = d < HEAD_DIM
    scratch = scratch_ptr + pid * L_BLOCK
    for start in range(0, length, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        ok = j < length
        slot = tl.load(read_slots_ptr + first + j, mask=ok, other=0)
        k = tl.load(keys_ptr + slot[:, None] * KEY_STRIDE + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        score = tl.zeros([BLOCK_K], dtype=tl.float32)
        for h in tl.static_range(HEADS):
            qh = tl.load(q_ptr + row * q_row_stride + h * Q_HEAD_STRIDE + d, mask=d_ok, other=0.0).to(tl.float32)
            wh = tl.load(w_ptr + row * w_row_stride + h).to(tl.float32)
            score += wh * tl.maximum(tl.sum(k * qh[None, :], axis=1), 0.0)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 ranks as +0.0, as the reference's float compare does
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        tl.store(scratch + j, (ordered << 32) | (_LOW - j.to(tl.int64)), mask=ok)
    tl.debug_barrier()  # the row's scores, written by every thread of the program, are read back whole below

    p = tl.arange(0, L_BLOCK)
    ranked = tl.sort(tl.load(scratch + p, mask=p < length, other=_INT64_MIN), descending=True)
    picked = (p < length) & ((ranked >> 32) != _NEG_INF_ORDERED)
    j = _LOW - (ranked & _LOW)
    slot = tl.load(read_slots_ptr + first + j, mask=picked, other=-1)
    tl.store(out_ptr + row * TOPK + p, tl.where(picked, slot, -1), mask=p < TOPK)


def sort_warps(l_block: int) -> int:
    """Warps for a sort of ``l_block`` keys: about eight a thread from 2048 up. Fewer keys a thread also compile
    faster (the bitonic sort is unrolled per thread: 8192 keys take 17 s to compile on 8 warps, 4.5 s on 32), and every
    width is compiled at build."""
    return min(32, max(4, l_block // 256))


def index_topk(index_q: Tensor, head_weights: Tensor, keys: Tensor, read_slots: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, num_tokens: int, num_requests: int, l_block: int, out: Tensor,
               scratch: Tensor) -> None:
    """Launches the kernel over ``out``'s rows in chunks of ``scratch``'s rows; shapes as in
    :func:`bcg.ops.kernels.dsa_topk.index_topk`, ``scratch`` int64 ``(rows, l_block)``."""
    heads, head_dim = index_q.shape[1], index_q.shape[2]
    num_rows, topk = out.shape
    warps = sort_warps(l_block)
    for row0 in range(0, num_rows, scratch.shape[0]):
        launch(_index_topk_kernel, (min(scratch.shape[0], num_rows - row0),), index_q, index_q.stride(0),
               head_weights, head_weights.stride(0), keys, read_slots, cu_seqlens_q, cu_seqlens_k, scratch, out,
               num_tokens, num_requests, row0, HEADS=heads, HEAD_DIM=head_dim,
               D_BLOCK=triton.next_power_of_2(head_dim), Q_HEAD_STRIDE=index_q.stride(1), KEY_STRIDE=keys.stride(0),
               TOPK=topk, L_BLOCK=l_block, BLOCK_K=64, R_BLOCK=64, num_warps=warps)
