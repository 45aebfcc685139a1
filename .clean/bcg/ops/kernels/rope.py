# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""Split of the fused qkv projection, optional per-head q/k RMSNorm, RoPE on q and k, and the copy into the
attention island's input buffers: one kernel per layer on CUDA.

The input is the qkv projection's output ``(T, (H + 2 * KV) * D)``: q heads, then k heads, then v heads. RoPE is
the non-interleaved "rotate half" form, with angles ``positions * inv_freq`` computed in fp32 from int positions
(no cos/sin tables). Numerics (both implementations), as :mod:`bcg.models.layers` and ``dense.QKVProjection``:

* without q/k norms: q and k are rotated in fp32 (``x * cos + rotate_half(x) * sin``, products and sum rounded
  to fp32 one by one) and rounded once into the output dtype;
* with them: each head is RMS-normed over ``D`` (fp32 reduction, rounded once to the input dtype, as
  ``F.rms_norm``), then rotated in fp32 and rounded into the output dtype;
* v is copied (cast to its output's dtype);
* with ``cache=(k_cache, v_cache, slots)``, k and v as written are also stored at row ``slots[t]`` of the two caches:
  the attention layer's K/V write, done by the same kernel instead of two more launches.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg.ops.kernels.dispatch import kernel_path
from bcg.ops.kernels.library import kernel_op

__all__ = ["qkv_norm_rope", "qkv_norm_rope_reference", "rope_angles", "rotate"]


def rope_angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``(T, 1, head_dim)`` for int ``positions``, in fp32, with the first half of ``sin``
    negated: the sign of rotate-half folded in once per forward, so every rotation swaps the halves with one cat
    instead of a negation and a cat (exact: only signs move).

    Example:
        >>> cos, sin = rope_angles(torch.arange(3), torch.ones(2))
        >>> cos.shape, bool(sin[1, 0, 0] < 0 < sin[1, 0, 2])
        (torch.Size([3, 1, 4]), True)
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    sin = angles.sin()
    sin[..., : angles.shape[-1] // 2].neg_()
    return angles.cos(), sin


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(T, heads, head_dim)`` by the angles behind ``cos``/``sin``, in fp32.

    Non-interleaved "rotate half" RoPE: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``.
    ``sin`` comes from :func:`rope_angles` with that minus sign folded into its first half, so the halves only
    swap. The math runs in fp32 (angles at large positions lose too much in bf16): a half-precision ``x`` times the
    fp32 angles promotes exactly, the same numbers as casting ``x`` first with one kernel fewer. ``x`` may be a
    strided view (q and k heads side by side in a fused projection). The result stays fp32, so a caller that copies
    it anyway (a bridge buffer) casts in that copy.

    Example:
        >>> cos, sin = rope_angles(torch.zeros(2, dtype=torch.long), torch.ones(4))
        >>> x = torch.randn(2, 1, 8)
        >>> torch.equal(rotate(x, cos, sin), x)  # position 0 is the identity
        True
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def qkv_norm_rope_reference(
    qkv: Tensor, positions: Tensor, inv_freq: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
    eps: float, q_out: Tensor, k_out: Tensor, v_out: Tensor,
) -> None:
    """Plain-torch split + q/k norm + RoPE + copy into ``q_out (T, H, D)``, ``k_out``, ``v_out (T, KV, D)``."""
    num_rows, heads, kv_heads, dim = q_out.shape[0], q_out.shape[1], k_out.shape[1], q_out.shape[2]
    qk = qkv[:, : (heads + kv_heads) * dim].view(num_rows, heads + kv_heads, dim)
    cos, sin = rope_angles(positions, inv_freq)
    if q_weight is not None and k_weight is not None:
        q_out.copy_(rotate(F.rms_norm(qk[:, :heads], (dim,), q_weight, eps), cos, sin))
        k_out.copy_(rotate(F.rms_norm(qk[:, heads:], (dim,), k_weight, eps), cos, sin))
    else:
        rotated = rotate(qk, cos, sin)
        q_out.copy_(rotated[:, :heads])
        k_out.copy_(rotated[:, heads:])
    v_out.copy_(qkv[:, (heads + kv_heads) * dim :].view(num_rows, kv_heads, dim))


def _check(qkv: Tensor, positions: Tensor, inv_freq: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
           q_out: Tensor, k_out: Tensor, v_out: Tensor) -> None:
    num_rows, heads, dim = q_out.shape
    kv_heads = k_out.shape[1]
    problems = []
    if qkv.dim() != 2 or qkv.shape != (num_rows, (heads + 2 * kv_heads) * dim):
        width = (heads + 2 * kv_heads) * dim
        problems.append(f"qkv {tuple(qkv.shape)} is not (T, (H + 2*KV) * D) = ({num_rows}, {width})")
    if k_out.shape != (num_rows, kv_heads, dim) or v_out.shape != (num_rows, kv_heads, dim):
        problems.append(f"k_out {tuple(k_out.shape)} and v_out {tuple(v_out.shape)} must both be (T, KV, D)")
    if positions.shape != (num_rows,):
        problems.append(f"positions {tuple(positions.shape)} is not (T,) = ({num_rows},)")
    if dim % 2 or inv_freq.shape != (dim // 2,):
        problems.append(f"inv_freq {tuple(inv_freq.shape)} is not (D / 2,) for an even head_dim D = {dim}")
    if (q_weight is None) != (k_weight is None):
        problems.append("q_weight and k_weight go together (Qwen3-style q/k norm): pass both or neither")
    if any(t.stride(-1) != 1 for t in (qkv, q_out, k_out, v_out)):
        problems.append("qkv, q_out, k_out and v_out need a contiguous last dimension")
    if problems:
        raise ValueError("qkv_norm_rope: " + "; ".join(problems))


def qkv_norm_rope(
    qkv: Tensor, positions: Tensor, inv_freq: Tensor, num_heads: int, num_kv_heads: int, *,
    q_weight: Optional[Tensor] = None, k_weight: Optional[Tensor] = None, eps: float = 1e-6,
    out: Optional[tuple[Tensor, Tensor, Tensor]] = None, impl: str = "fused",
    cache: Optional[tuple[Tensor, Tensor, Tensor]] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``q (T, H, D), k, v (T, KV, D)`` from the fused projection ``qkv (T, (H + 2 * KV) * D)``.

    q and k are RMS-normed per head when ``q_weight``/``k_weight`` ``(D,)`` are given, then rotated by
    ``positions (T,)`` (int) times ``inv_freq (D / 2,)`` (fp32). With ``out=(q_out, k_out, v_out)`` the results are
    written there (any dtype, contiguous last dimension, rows and heads may be strided: the attention island's
    bridge buffers), else into new tensors of ``qkv``'s dtype. ``qkv`` may be row-strided. With
    ``cache=(k_cache, v_cache, slots)`` (caches ``(S, KV, D)`` with a contiguous last dimension, ``slots (T,)`` int64)
    k and v are also written at their slots, as ``k_cache.index_copy_(0, slots, k)`` would.

    Example:
        >>> qkv, inv_freq = torch.randn(5, (4 + 2 * 2) * 8), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> q, k, v = qkv_norm_rope(qkv, torch.arange(5), inv_freq, 4, 2)
        >>> q.shape, k.shape, torch.equal(v.flatten(1), qkv[:, 48:])
        (torch.Size([5, 4, 8]), torch.Size([5, 2, 8]), True)
    """
    num_rows, width = qkv.shape
    dim = width // (num_heads + 2 * num_kv_heads)
    if out is None:
        out = (qkv.new_empty(num_rows, num_heads, dim), qkv.new_empty(num_rows, num_kv_heads, dim),
               qkv.new_empty(num_rows, num_kv_heads, dim))
    q_out, k_out, v_out = out
    if q_out.shape[1:] != (num_heads, dim):
        raise ValueError(f"q_out {tuple(q_out.shape)} is not (T, {num_heads}, {dim})")
    _check(qkv, positions, inv_freq, q_weight, k_weight, q_out, k_out, v_out)
    if cache is not None:
        check_cache(cache, k_out)
    path = kernel_path(impl, qkv)
    if path == "triton":
        from bcg.ops.kernels import triton_rope

        triton_rope.qkv_norm_rope(qkv, positions, inv_freq, q_weight, k_weight, eps, q_out, k_out, v_out, cache)
        return q_out, k_out, v_out
    if path == "torch":
        qkv_norm_rope_reference(qkv, positions, inv_freq, q_weight, k_weight, eps, q_out, k_out, v_out)
    else:  # traced: the op's new q, k, v copied into the outputs (Inductor drops copies into fresh tensors)
        q, k, v = torch.ops.bcg.qkv_norm_rope(qkv, positions, inv_freq, q_weight, k_weight, eps, num_heads,
                                              num_kv_heads)
        for dst, src in ((q_out, q), (k_out, k), (v_out, v)):
            dst.copy_(src)
    if cache is not None:  # the reference (and the traced op) write the caches apart
        k_cache, v_cache, slots = cache
        k_cache.index_copy_(0, slots, k_out.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v_out.to(v_cache.dtype))
    return q_out, k_out, v_out


def check_cache(cache: tuple[Tensor, Tensor, Tensor], k_out: Tensor) -> None:
    k_cache, v_cache, slots = cache
    num_rows, kv_heads, dim = k_out.shape
    problems = []
    if k_cache.shape[1:] != (kv_heads, dim) or v_cache.shape[1:] != (kv_heads, dim):
        problems.append(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                        f"(S, {kv_heads}, {dim})")
    if slots.shape != (num_rows,) or slots.dtype != torch.int64:
        problems.append(f"slots {tuple(slots.shape)} {slots.dtype} is not int64 (T,) = ({num_rows},)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        problems.append("k_cache and v_cache need a contiguous last dimension")
    if problems:
        raise ValueError("qkv_norm_rope cache: " + "; ".join(problems))


# --- The op (bcg.ops.kernels.library): it allocates q, k, v as its fake kernel does, then fills them. No cache
# write: a traced forward has no KV destination (bcg.ops.attention.kv_destination), its attention writes the pool. ---
def _qkv_norm_rope_fake(
    qkv: Tensor, positions: Tensor, inv_freq: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
    eps: float, num_heads: int, num_kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    rows, dim = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    return (qkv.new_empty(rows, num_heads, dim), qkv.new_empty(rows, num_kv_heads, dim),
            qkv.new_empty(rows, num_kv_heads, dim))


def _qkv_norm_rope_op(
    qkv: Tensor, positions: Tensor, inv_freq: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
    eps: float, num_heads: int, num_kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = _qkv_norm_rope_fake(qkv, positions, inv_freq, q_weight, k_weight, eps, num_heads, num_kv_heads)
    qkv_norm_rope_reference(qkv, positions, inv_freq, q_weight, k_weight, eps, q, k, v)
    return q, k, v


def _qkv_norm_rope_triton(
    qkv: Tensor, positions: Tensor, inv_freq: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
    eps: float, num_heads: int, num_kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    from bcg.ops.kernels import triton_rope

    q, k, v = _qkv_norm_rope_fake(qkv, positions, inv_freq, q_weight, k_weight, eps, num_heads, num_kv_heads)
    triton_rope.qkv_norm_rope(qkv, positions, inv_freq, q_weight, k_weight, eps, q, k, v)
    return q, k, v


kernel_op("qkv_norm_rope", mutates_args=(), reference=_qkv_norm_rope_op, triton=_qkv_norm_rope_triton,
          fake=_qkv_norm_rope_fake)
