"""Variable-length causal attention forward as one Triton kernel (FlashAttention-2's algorithm), written in place.

One program computes ``BLOCK_M`` query rows of one sequence for one query head: it walks the sequence's visible keys
in ``BLOCK_N`` blocks with an online softmax (running max and denominator in fp32, scores and the output accumulated
in fp32 on the tensor cores), then divides once and stores the rows straight into ``out``. The grid is
``(cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads)``: ``max_seqlen_q`` is a host upper bound, so programs past a
sequence's end return at once and nothing is read back to the host. Rows of no sequence are never written, unless
``zero_tail``: then the programs of the last sequence also zero the rows after it (the padded rows of a bucket: one
kernel, no fill before it).

Keys and values are read directly (key ``j`` of sequence ``s`` is row ``cu_k[s] + j`` of ``k``/``v``) or, with
``kv_slots``, through a slot index (row ``kv_slots[cu_k[s] + j]``): the kernel then attends straight from a KV pool's
layer, with no gather of each request's keys first. Only slots of keys inside a sequence are read. ``kv_base``
gives per sequence the pool row its keys run up from: with ``kv_slots``, a sequence with a base (``>= 0``) reads by
address and the others through their slots (two key loops in one kernel); alone, every sequence reads by address
(one loop: the direct mode's code from another start).

Masks, per sequence with ``Lq`` queries and ``Lk`` keys, bottom-right aligned (queries are the last ``Lq`` of the
keys' positions, as with a cached prefix): query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq`` and, with a left window
``w >= 0``, ``j >= i + Lk - Lq - w``. Key blocks entirely outside that band are skipped, not masked, and those
every row of the program sees in full (below the first row's diagonal, inside the last row's window) run in a loop
of their own with no mask at all (FlashAttention's split of the causal loop): only the blocks on the band's edges
pay for the comparisons. Soft-capping
(``cap * tanh(s / cap)`` of the scaled score ``s``) and per-head sink logits (one more softmax column with no value,
gpt-oss's) are compile-time switches. A row that sees no key gets 0.

Block sizes are fixed per head dim and query length (:func:`block_config`; no autotuning, which benchmarks and so
syncs the host: it cannot run inside a graph capture). Triton compiles each configuration at its first call: warm up
before capturing. Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from bcg import env
from bcg.ops.kernels.attention_blocks import BlockConfig, block_config
from bcg.ops.kernels.triton_attention_keys import attend_keys
from bcg.ops.kernels.triton_utils import INTERPRETING, grid_dependency, launch

__all__ = ["BlockConfig", "block_config", "varlen_attention"]


@triton.jit
def _flat_block(CU_Q, num_seqs, pid, BLOCK_M: tl.constexpr, SEQS: tl.constexpr):
    """Program ``pid`` of a flat grid: ``(seq, pid_m)``, its sequence and row block, counting only the blocks
    sequences have (``seq == num_seqs``: a block of the rows past the last sequence, ``pid_m`` counted from there).
    ``SEQS`` is a power of two of at least ``num_seqs``."""
    offs = tl.arange(0, SEQS)
    live = offs < num_seqs
    starts = tl.load(CU_Q + offs, mask=live, other=0)
    ends = tl.load(CU_Q + offs + 1, mask=live, other=0)
    blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    ends_blk = tl.cumsum(blocks, axis=0)  # each sequence's blocks end here, in the flat order
    seq = tl.sum((ends_blk <= pid).to(tl.int32), axis=0)  # sequences (empty ones too) wholly before pid
    seq = tl.minimum(seq, num_seqs)
    first = tl.sum(tl.where(offs == seq, ends_blk - blocks, 0), axis=0)
    first = tl.where(seq == num_seqs, tl.sum(blocks, axis=0), first)
    return seq, pid - first


@triton.jit
def _varlen_fwd(
    Q, K, V, OUT, CU_Q, CU_K, SINKS, KV_SLOTS, KV_BASE, total_q, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    sm_scale, softcap, window_left,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    STATIC_BLOCKS_N: tl.constexpr, HAS_KV_SLOTS: tl.constexpr, ZERO_TAIL: tl.constexpr, SPLIT_MASK: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_KV_BASE: tl.constexpr, FLAT_SEQS: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    if FLAT_SEQS > 0:
        # A flat grid: one program per row block a sequence has, then the blocks of the rows past the last one.
        seq, pid_m = _flat_block(CU_Q, num_seqs, tl.program_id(0), BLOCK_M, FLAT_SEQS)
        head = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        if seq == num_seqs:
            if ZERO_TAIL:
                tail = tl.load(CU_Q + num_seqs) + offs_m
                t_ptrs = OUT + tail[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
                tl.store(t_ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(OUT.dtype.element_ty),
                         mask=(tail < total_q)[:, None] & d_ok[None, :])
            return
        q_start = tl.load(CU_Q + seq)
        len_q = tl.load(CU_Q + seq + 1) - q_start
    else:
        pid_m = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(CU_Q + seq)
        q_end = tl.load(CU_Q + seq + 1)
        len_q = q_end - q_start
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        if ZERO_TAIL:
            if seq == tl.num_programs(1) - 1:
                # Rows past the last sequence (the host sizes the grid to cover them): zeros, in this same launch.
                tail = q_end + offs_m
                t_ptrs = OUT + tail[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
                tl.store(t_ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(OUT.dtype.element_ty),
                         mask=(tail < total_q)[:, None] & d_ok[None, :])
    if pid_m * BLOCK_M >= len_q:
        return
    k_start = tl.load(CU_K + seq)
    len_k = tl.load(CU_K + seq + 1) - k_start
    kv_head = head // GROUP

    row_ok = offs_m < len_q
    q_ptrs = Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # The last key each row sees (bottom-right causal), and the band of key blocks this row block can see.
    diag = offs_m + (len_k - len_q)
    hi = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + len_k - len_q)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, pid_m * BLOCK_M + len_k - len_q - window_left)
        lo = (lo // BLOCK_N) * BLOCK_N

    if HAS_SOFTCAP:
        score_scale = sm_scale / softcap
    else:
        score_scale = sm_scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    # The blocks every row of this program sees in full, [lo_full, hi_full): up to the first row's diagonal and,
    # with a window, from the last row's window start. They run without masks; the blocks around them (the
    # diagonal's, the window's edge) with them. SPLIT_MASK=False masks every block (the benchmark's comparison).
    if SPLIT_MASK:
        diag_first = pid_m * BLOCK_M + len_k - len_q
        hi_full = tl.maximum(0, (diag_first + 1) // BLOCK_N * BLOCK_N)
        if HAS_WINDOW:
            diag_last = tl.minimum((pid_m + 1) * BLOCK_M, len_q) - 1 + len_k - len_q
            lo_full = tl.cdiv(tl.maximum(0, diag_last - window_left), BLOCK_N) * BLOCK_N
        else:
            lo_full = lo
        no_full = lo_full >= hi_full
        lo_full = tl.where(no_full, lo, lo_full)
        hi_full = tl.where(no_full, lo, hi_full)
    else:
        lo_full = lo
        hi_full = lo
    if HAS_KV_BASE and HAS_KV_SLOTS:
        # A request whose slots are one ascending run (KV_BASE[seq] >= 0: its first key's pool row) reads its keys
        # by address, as the direct mode does: no slot load for the K/V loads to wait on; the others through them.
        base = tl.load(KV_BASE + seq)
        if base >= 0:
            acc, m_i, l_i = attend_keys(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, base, len_k, lo, lo_full,
                                         hi_full, hi, diag, stride_kt, stride_vt, score_scale, softcap, window_left,
                                         offs_n, offs_d, d_ok, HAS_SOFTCAP, HAS_WINDOW, False, EVEN_D,
                                         STATIC_BLOCKS_N, BLOCK_N)
        else:
            acc, m_i, l_i = attend_keys(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, lo, lo_full,
                                         hi_full, hi, diag, stride_kt, stride_vt, score_scale, softcap, window_left,
                                         offs_n, offs_d, d_ok, HAS_SOFTCAP, HAS_WINDOW, True, EVEN_D,
                                         STATIC_BLOCKS_N, BLOCK_N)
    else:
        if HAS_KV_BASE:  # every request a run (the caller's promise): one key loop, by address from its first row
            k_start = tl.load(KV_BASE + seq)
        acc, m_i, l_i = attend_keys(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, lo, lo_full, hi_full,
                                     hi, diag, stride_kt, stride_vt, score_scale, softcap, window_left, offs_n, offs_d,
                                     d_ok, HAS_SOFTCAP, HAS_WINDOW, HAS_KV_SLOTS, EVEN_D, STATIC_BLOCKS_N, BLOCK_N)

    if HAS_SINKS:
        # One more softmax column per head with no value: it only grows the denominator.
        sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw nothing: acc is 0, and so is its output
    o = acc / l_safe[:, None]
    o_ptrs = OUT + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, out: Tensor, scale: float | None = None, softcap: float | None = None,
                     window_left: int | None = None, sinks: Tensor | None = None,
                     config: BlockConfig | None = None, kv_slots: Tensor | None = None,
                     zero_tail: bool = False, kv_base: Tensor | None = None, flat_grid: bool | None = None) -> None:
    """Launches the kernel: causal attention of ``q`` over ``k``/``v`` per sequence, written into ``out``.

    Shapes and checks are the caller's (:func:`bcg.ops.kernels.attention.varlen_attention`): q/out
    ``(total_q, H, D)``, k/v ``(total_k, H_kv, D)`` (with ``kv_slots`` or ``kv_base``: any number of rows, the
    pool's), last dims contiguous, int32 cumulative lengths of one length, ``kv_slots`` int32/int64 contiguous;
    ``kv_base`` int64, one per sequence: its first key's row where its keys run up by one, else -1 (alone: every
    non-empty sequence has one). ``zero_tail``
    zeroes the rows past the last sequence. ``config`` overrides :func:`block_config` (benchmarks tune with it).
    ``flat_grid`` launches one program per row block a sequence has (found from ``cu_seqlens_q`` in the kernel)
    instead of ``max_seqlen_q``'s blocks for every sequence, whose programs past a short or empty sequence return at
    once (None: ``BCG_VARLEN_GRID``, :mod:`bcg.env`).
    """
    num_seqs = cu_seqlens_q.numel() - 1
    total_q, num_heads, head_dim = q.shape
    cfg = config or block_config(head_dim, max_seqlen_q)
    flat = env.VARLEN_GRID == "flat" if flat_grid is None else flat_grid
    if flat:
        # Each sequence's blocks, less one each but for a partial one, and the tail's: at most this many.
        grid: tuple[int, ...] = (triton.cdiv(total_q, cfg.block_m) + num_seqs, num_heads)
    else:
        # The tail has at most total_q rows: with zero_tail the grid covers them too (the bucket is max_seqlen_q).
        rows = max(max_seqlen_q, total_q) if zero_tail else max_seqlen_q
        grid = (triton.cdiv(rows, cfg.block_m), num_seqs, num_heads)
    block_d = max(16, triton.next_power_of_2(head_dim))
    launch(_varlen_fwd, grid, q, k, v, out, cu_seqlens_q, cu_seqlens_k, sinks if sinks is not None else q,
           kv_slots if kv_slots is not None else cu_seqlens_k,
           kv_base if kv_base is not None else cu_seqlens_k, total_q,
           num_seqs if flat else None,  # None: a constant (the per-sequence grid's code keeps its registers)
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
           scale if scale is not None else head_dim ** -0.5, softcap or 1.0,
           window_left if window_left is not None and window_left >= 0 else 0,
           HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=num_heads // k.shape[1],
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SOFTCAP=bool(softcap),
           HAS_WINDOW=window_left is not None and window_left >= 0, HAS_SINKS=sinks is not None,
           STATIC_BLOCKS_N=triton.cdiv(max_seqlen_k, cfg.block_n) if INTERPRETING else 0,
           HAS_KV_SLOTS=kv_slots is not None, ZERO_TAIL=zero_tail, SPLIT_MASK=cfg.split_mask,
           EVEN_D=block_d == head_dim, HAS_KV_BASE=kv_base is not None,
           # A power of two of sequences the flat grid's search covers: 16 at least, so batches of up to 16
           # requests share one compiled kernel (an island compiles at its first batch of a new size).
           FLAT_SEQS=max(16, triton.next_power_of_2(num_seqs)) if flat else 0, num_warps=cfg.num_warps,
           num_stages=cfg.num_stages)
