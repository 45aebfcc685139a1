"""The key loop of bcg's varlen attention kernel (:mod:`bcg.ops.kernels.triton_attention`): one online-softmax step
over a block of keys, and the walk over a program's key blocks, masked only at the causal band's and the window's
edges. Keys are read directly (row ``k_start + j``), or through a slot index (row ``KV_SLOTS[k_start + j]``).
Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from bcg.ops.kernels.triton_utils import INTERPRETING

__all__ = ["attend_keys"]

_ACCURATE_TANH = tl.constexpr(not INTERPRETING)  # the interpreter has no libdevice
# The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those integers: it gets fp32 operands instead
# (exact: bf16 -> fp32 is lossless, and the compiled dot accumulates in fp32 too).
_DOT_F32 = tl.constexpr(INTERPRETING)


@triton.jit
def _tanh(x):
    if _ACCURATE_TANH:
        return libdevice.tanh(x)
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _key_block(q, acc, m_i, l_i, k_base, v_base, kv_slots, k_start, len_k, start_n, in_band, diag, stride_kt,
               stride_vt, score_scale, softcap, window_left, offs_n, offs_d, d_ok, HAS_SOFTCAP: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_KV_SLOTS: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One step of the online softmax: the scores of ``BLOCK_N`` keys from ``start_n``, masked, folded into the
    running max ``m_i``, denominator ``l_i`` and output ``acc`` (all fp32, the max in log2 units). ``MASKED=False``:
    a block every row of the program sees in full (inside the sequence, the causal band and the window), loaded and
    scored with no mask at all."""
    cols = start_n + offs_n
    if MASKED:
        col_ok = (cols < len_k) & in_band
    if HAS_KV_SLOTS:  # the pool rows of these keys; keys outside the sequence read no slot (it may be anything)
        if MASKED:
            kv_rows = tl.load(kv_slots + k_start + cols, mask=col_ok, other=0).to(tl.int64)
        else:
            kv_rows = tl.load(kv_slots + k_start + cols).to(tl.int64)
    else:
        kv_rows = (k_start + cols).to(tl.int64)
    k_ptrs = k_base + kv_rows[None, :] * stride_kt + offs_d[:, None]
    if MASKED:
        k = tl.load(k_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
    if _DOT_F32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * score_scale
    else:
        s = tl.dot(q, k) * score_scale
    if HAS_SOFTCAP:
        s = _tanh(s) * (softcap * 1.4426950408889634)
    if MASKED:
        visible = col_ok[None, :] & (cols[None, :] <= diag[:, None])
        if HAS_WINDOW:
            visible = visible & (cols[None, :] >= diag[:, None] - window_left)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps a max of -inf: subtract 0 instead, so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + kv_rows[:, None] * stride_vt + offs_d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    if _DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def attend_keys(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, lo, lo_full, hi_full, hi, diag,
                 stride_kt, stride_vt, score_scale, softcap, window_left, offs_n, offs_d, d_ok,
                 HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KV_SLOTS: tl.constexpr,
                 EVEN_D: tl.constexpr, STATIC_BLOCKS_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's key blocks in ``[lo, hi)``: masked before ``lo_full`` and from ``hi_full``, unmasked between."""
    if STATIC_BLOCKS_N == 0:
        if HAS_WINDOW:
            for start_n in range(lo, lo_full, BLOCK_N):
                acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, start_n,
                                           True, diag, stride_kt, stride_vt, score_scale, softcap, window_left,
                                           offs_n, offs_d, d_ok, HAS_SOFTCAP, HAS_WINDOW, HAS_KV_SLOTS, True, EVEN_D)
        for start_n in range(lo_full, hi_full, BLOCK_N):
            acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, start_n, True,
                                       diag, stride_kt, stride_vt, score_scale, softcap, window_left, offs_n, offs_d,
                                       d_ok, HAS_SOFTCAP, HAS_WINDOW, HAS_KV_SLOTS, False, EVEN_D)
        for start_n in range(hi_full, hi, BLOCK_N):
            acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, start_n, True,
                                       diag, stride_kt, stride_vt, score_scale, softcap, window_left, offs_n, offs_d,
                                       d_ok, HAS_SOFTCAP, HAS_WINDOW, HAS_KV_SLOTS, True, EVEN_D)
    else:
        # The interpreter's loops: a fixed count, each block taking the compiled loops' path for its place (blocks
        # outside [lo, hi) masked out as a whole): the compiled loops' ranges have runtime bounds, which Triton
        # 3.6's interpreter cannot take under numpy >= 2.4.
        for block in range(STATIC_BLOCKS_N):
            start_n = block * BLOCK_N
            if (start_n >= lo_full) & (start_n < hi_full):
                acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, start_n,
                                           True, diag, stride_kt, stride_vt, score_scale, softcap, window_left,
                                           offs_n, offs_d, d_ok, HAS_SOFTCAP, HAS_WINDOW, HAS_KV_SLOTS, False,
                                           EVEN_D)
            else:
                acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_base, v_base, KV_SLOTS, k_start, len_k, start_n,
                                           (start_n >= lo) & (start_n < hi), diag, stride_kt, stride_vt,
                                           score_scale, softcap, window_left, offs_n, offs_d, d_ok, HAS_SOFTCAP,
                                           HAS_WINDOW, HAS_KV_SLOTS, True, EVEN_D)
    return acc, m_i, l_i
