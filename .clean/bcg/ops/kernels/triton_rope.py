"""Triton kernel behind :mod:`bcg.ops.kernels.rope`: one program per token, all of its heads in registers.

The angles of a token are computed once (``D / 2`` sines and cosines) and shared by its q and k heads; q and k
heads are one ``(H + KV, D / 2)`` tile per half, v one ``(KV, D)`` tile. Importing this module needs Triton.
"""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from bcg.ops.kernels.triton_utils import cos_f32, grid_dependency, launch_rows, sin_f32


@triton.jit
def _qkv_norm_rope_kernel(
    qkv_ptr, qkv_stride, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps,
    q_ptr, q_stride0, q_stride1, k_ptr, k_stride0, k_stride1, v_ptr, v_stride0, v_stride1,
    slot_ptr, kc_ptr, kc_stride0, kc_stride1, vc_ptr, vc_stride0, vc_stride1,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_NORM: tl.constexpr, HAS_CACHE: tl.constexpr,
    QK_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    grid_dependency()  # under programmatic dependent launch: the kernel before is done
    HALF: tl.constexpr = DIM // 2
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_BLOCK)
    j_ok = j < HALF
    # Angles in fp32 exactly as the reference: float(position) * inv_freq, one rounding.
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    cos = cos_f32(angle)[None, :]
    sin = sin_f32(angle)[None, :]

    h = tl.arange(0, QK_BLOCK)[:, None]
    mask = (h < HEADS + KV_HEADS) & j_ok[None, :]
    src = qkv_ptr + t * qkv_stride + h * DIM + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if HAS_NORM:
        is_q = h < HEADS
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / DIM + eps)[:, None]
        qw1 = tl.load(qw_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        # Rounded to the input dtype, as the norm's output is before the rotation reads it.
        x1 = (x1f * rstd * tl.where(is_q, qw1, kw1)).to(qkv_ptr.dtype.element_ty)
        x2 = (x2f * rstd * tl.where(is_q, qw2, kw2)).to(qkv_ptr.dtype.element_ty)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # rotate_half(x) = (-x2, x1): products and sums rounded one by one (the launch turns off FMA contraction).
    o1 = x1f * cos - x2f * sin
    o2 = x2f * cos + x1f * sin

    q_dst = q_ptr + t * q_stride0 + h * q_stride1 + j[None, :]
    q_mask = (h < HEADS) & j_ok[None, :]
    tl.store(q_dst, o1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=q_mask)
    k_dst = k_ptr + t * k_stride0 + (h - HEADS) * k_stride1 + j[None, :]
    k_mask = (h >= HEADS) & mask
    k1, k2 = o1.to(k_ptr.dtype.element_ty), o2.to(k_ptr.dtype.element_ty)
    tl.store(k_dst, k1, mask=k_mask)
    tl.store(k_dst + HALF, k2, mask=k_mask)

    hv = tl.arange(0, V_BLOCK)[:, None]
    d = tl.arange(0, DIM_BLOCK)[None, :]
    v_mask = (hv < KV_HEADS) & (d < DIM)
    v = tl.load(qkv_ptr + t * qkv_stride + (HEADS + KV_HEADS) * DIM + hv * DIM + d, mask=v_mask, other=0.0)
    v = v.to(v_ptr.dtype.element_ty)
    tl.store(v_ptr + t * v_stride0 + hv * v_stride1 + d, v, mask=v_mask)
    if HAS_CACHE:
        # The same k and v (as rounded above) at the token's KV-pool slot: the K/V write of the attention layer.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kc_dst = kc_ptr + slot * kc_stride0 + (h - HEADS) * kc_stride1 + j[None, :]
        tl.store(kc_dst, k1.to(kc_ptr.dtype.element_ty), mask=k_mask)
        tl.store(kc_dst + HALF, k2.to(kc_ptr.dtype.element_ty), mask=k_mask)
        tl.store(vc_ptr + slot * vc_stride0 + hv * vc_stride1 + d, v.to(vc_ptr.dtype.element_ty), mask=v_mask)


def qkv_norm_rope(
    qkv: Tensor, positions: Tensor, inv_freq: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
    eps: float, q_out: Tensor, k_out: Tensor, v_out: Tensor,
    cache: Optional[tuple[Tensor, Tensor, Tensor]] = None,
) -> None:
    """Write ``q_out (T, H, D)``, ``k_out``, ``v_out (T, KV, D)`` from ``qkv (T, (H + 2 * KV) * D)``, and with
    ``cache=(k_cache, v_cache, slots)`` also k and v at row ``slots[t]`` of the caches."""
    num_rows, heads, dim = q_out.shape
    kv_heads = k_out.shape[1]
    has_norm = q_weight is not None and k_weight is not None
    k_cache, v_cache, slots = cache if cache is not None else (k_out, v_out, positions)  # unread without a cache
    qk_block = triton.next_power_of_2(heads + kv_heads)
    half_block = max(2, triton.next_power_of_2(dim // 2))
    elements = 2 * qk_block * half_block
    launch_rows(
        _qkv_norm_rope_kernel, num_rows,
        qkv, qkv.stride(0), positions, inv_freq,
        q_weight if has_norm else inv_freq, k_weight if has_norm else inv_freq, eps,  # unread without norms
        q_out, q_out.stride(0), q_out.stride(1), k_out, k_out.stride(0), k_out.stride(1),
        v_out, v_out.stride(0), v_out.stride(1),
        slots, k_cache, k_cache.stride(0), k_cache.stride(1), v_cache, v_cache.stride(0), v_cache.stride(1),
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HAS_NORM=has_norm, HAS_CACHE=cache is not None,
        QK_BLOCK=qk_block, V_BLOCK=triton.next_power_of_2(kv_heads), HALF_BLOCK=half_block,
        DIM_BLOCK=2 * half_block,
        num_warps=1 if elements <= 512 else 4 if elements <= 4096 else 8 if elements <= 16384 else 16,
        enable_fp_fusion=False,
    )
