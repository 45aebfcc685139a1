"""The q/k/v projection kernel's optional prologue (:mod:`bcg.ops.kernels.triton_qkv_rope`): the decoder layer's input
residual add and RMSNorm, folded into the projection so that their own kernel is not launched.

``rms_norm(h) @ W.T = rstd[m] * sum_k h[m, k] * w_norm[k] * W[n, k]``: the row's ``rstd`` factors out of the dot. So
each program, on the A tiles it loads anyway, forms ``h = x + residual`` (added in fp32 and rounded to the residual's
dtype, as :func:`~bcg.ops.kernels.fused_add_rms_norm` rounds it), sums the squares of ``h`` per row in fp32, and hands
the dot ``h * w_norm`` rounded to the operand dtype; the programs of column block 0 also write ``h`` (their rows, their
K range) to ``residual_out``, so every element of the new residual is written exactly once. With K split, each split
stores its partial sums of squares beside the accumulators' partials and the tile's last program adds them in split
order, as it adds the accumulators. ``rstd = rsqrt(ssq / hidden + eps)`` then scales the fp32 sums per row, before the
epilogue (and its bias: ``rms_norm(h) @ W.T + b``). Importing this module needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_a_tile(a, ssq, rows, row_ok, ks, k_ok, pid_n, res_ptr, res_stride, res_out_ptr, res_out_stride, nw_ptr,
                ADD: tl.constexpr):
    """The A tile ``a`` (``x``'s rows by one K step) as the dot reads it under the prologue, and ``ssq`` with this
    step's squares added: ``(h * w_norm)`` in ``a``'s dtype, ``h = a + residual`` with ``ADD`` (written to
    ``residual_out`` by the programs of column block 0), else ``h = a``."""
    if ADD:
        mask = row_ok[:, None] & k_ok[None, :]
        r_rows = rows.to(tl.int64)[:, None]
        r = tl.load(res_ptr + r_rows * res_stride + ks[None, :], mask=mask, other=0.0)
        # fused_add_rms_norm's sum: in fp32, rounded to the residual's dtype; the norm and the dot read that rounding
        h = (a.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        if pid_n == 0:  # one column block writes the sum; every other program only reads x and residual
            tl.store(res_out_ptr + r_rows * res_out_stride + ks[None, :], h, mask=mask)
    else:
        h = a
    hf = h.to(tl.float32)
    ssq += tl.sum(hf * hf, axis=1)
    w_norm = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return (hf * w_norm[None, :]).to(a.dtype), ssq


@triton.jit
def store_ssq(ssq_ptr, ssq, rows, row_ok, pid_n, pid_k, n_rows):
    """This split's partial sums of squares of ``rows``, in a slot of its own (split ``pid_k``, column block
    ``pid_n``): programs of other column blocks compute the same values, and no two programs write one address."""
    slot = (pid_k * tl.num_programs(0) + pid_n).to(tl.int64) * n_rows
    tl.store(ssq_ptr + slot + rows, ssq, mask=row_ok)


@triton.jit
def sum_ssq(ssq_ptr, rows, row_ok, pid_n, n_rows, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """The whole rows' sums of squares from the ``SPLIT_K`` slots :func:`store_ssq` wrote for column block ``pid_n``,
    added in split order (the same bits every run), read from L2 like the accumulators' partials."""
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in range(SPLIT_K):
        slot = (s * tl.num_programs(0) + pid_n).to(tl.int64) * n_rows
        ssq += tl.load(ssq_ptr + slot + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
    return ssq


@triton.jit
def scale_by_rstd(acc1, acc2, ssq, hidden, eps):
    """The two accumulators times their rows' ``rsqrt(mean(h^2) + eps)``, in fp32 (before the bias and the output
    rounding)."""
    rstd = tl.rsqrt(ssq / hidden + eps)[:, None]
    return acc1 * rstd, acc2 * rstd
