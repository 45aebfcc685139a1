"""The attention's q/k/v projection and what follows it, ``qkv_norm_rope(x @ weight.T + bias)``: one kernel at short
prompts.

At a few dozen rows the projection reads its weight for little work, and its ``(T, (H + 2 KV) D)`` output exists only
to be read once by :func:`~bcg.ops.kernels.qkv_norm_rope` (split, per-head q/k norm, RoPE, the island's inputs, the
K/V write). Up to :data:`MAX_FUSED_ROWS` rows of bf16/fp16 on CUDA, :func:`qkv_proj_rope` is one Triton kernel
(:mod:`bcg.ops.kernels.triton_qkv_rope`, K split over the SMs as the down projection's is) that does all of it in
the projection's epilogue, with the two steps' roundings; otherwise (larger batches, fp32, other devices, a head size
the tiles cannot split, a ``torch.compile`` trace, or ``BCG_QKV_FUSION=off``) it is the two steps, ``F.linear`` then
:func:`~bcg.ops.kernels.qkv_norm_rope`. The one kernel differs from them only in the matmul's summation order. It
keeps one counter per output tile in the split-K kernels' per-device buffer (:mod:`bcg.ops.kernels.tile_counters`),
so launches of it on two streams of one device must not run at the same time.

Why 16 rows (the H200, inside whole forwards, ``benchmarks/device_bound.py``): at 16 tokens the one kernel took 5.4 us
a layer on llama-dense against the two launches' 7.2 (device time 0.912 -> 0.864 ms) and 9.7 against 9.5 on the
Llama-3.2-1B shape (1.043 -> 1.039 ms); at 64 tokens 7.9 against 7.7, 11.1 against 10.4 and, on the Qwen3-0.6B shape
(whose per-head norms keep a whole head in one program), 12.9 against 9.7, with K split over the SMs or not. Alone on
weights read cold, as a forward reads them, it wins at 16 rows on all four shapes of ``benchmarks/qkv_kernels.py``.
cuBLAS's Hopper GEMMs (TMA loads, warp-specialised wgmma) are what a Triton GEMM with pointer loads has to match at
more rows.

The layer's input add + RMSNorm can ride the kernel's prologue (``norm_weight``, and ``residual``): the projection's
input is then ``rms_norm(x + residual, norm_weight, norm_eps)`` and the new residual stream ``x + residual`` comes back
too, so at short prompts the layer's first kernel (:func:`~bcg.ops.kernels.fused_add_rms_norm`) is not launched
(:mod:`bcg.ops.kernels.triton_qkv_prologue` has the arithmetic). The steps, where the kernel does not run, are bcg's
own: ``fused_add_rms_norm`` (or ``rms_norm``) into new buffers, then the two steps above, bit for bit what a caller
running them one after another gets. The kernel rounds differently from the steps: they round the normed rows
``h * rstd * w_norm`` to the operand dtype before the matmul, the kernel rounds ``h * w_norm`` and applies ``rstd`` to
the fp32 sums, so the two differ at the level of bf16 rounding (the sum ``h`` itself is the same bits). Models pass
these arguments only under ``BCG_INPUT_NORM_FUSION=on`` (:mod:`bcg.env`): in whole forwards on the H200 the kernel
with the prologue ran slower than the add + norm kernel and the plain kernel together.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor

from bcg import env
from bcg.ops.kernels.dispatch import kernel_path, num_sms
from bcg.ops.kernels.norm import fused_add_rms_norm, rms_norm
from bcg.ops.kernels.rope import check_cache, qkv_norm_rope
from bcg.ops.kernels.tile_counters import tile_counters

__all__ = ["MAX_FUSED_ROWS", "is_fused", "qkv_proj_rope"]

# Rows up to which the one kernel runs (see the module docstring; benchmarks/qkv_kernels.py measures it against the two
# steps per row count).
MAX_FUSED_ROWS = 16
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def is_fused(x: Tensor, weight: Tensor, bias: Tensor | None, head_dim: int, has_norm: bool, *,
             norm_weight: Tensor | None = None, residual: Tensor | None = None,
             residual_out: Tensor | None = None) -> bool:
    """Whether :func:`qkv_proj_rope` runs its one kernel for these operands (given the fused path on CUDA): a short
    half-precision batch, and half heads the tiles split (16-column blocks; a whole power-of-two half under a norm);
    with the prologue, a contiguous norm weight (any float dtype: read in fp32) and a residual (and its output) of
    ``x``'s dtype with contiguous rows."""
    half = head_dim // 2
    return (env.QKV_FUSION and 0 < x.shape[0] <= MAX_FUSED_ROWS and x.dim() == 2 and x.dtype in _FUSED_DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous() and head_dim % 2 == 0
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
            and half % 16 == 0 and (not has_norm or half & (half - 1) == 0)
            and (norm_weight is None or _prologue_fits(x, norm_weight, residual, residual_out)))


def _prologue_fits(x: Tensor, norm_weight: Tensor, residual: Tensor | None, residual_out: Tensor | None) -> bool:
    # Apart from is_fused so that a call without the prologue pays one `is None` for it (launches are host-bound).
    return norm_weight.is_contiguous() and all(t is None or (t.dtype == x.dtype and t.stride(-1) == 1)
                                               for t in (residual, residual_out))


@overload
def qkv_proj_rope(
    x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor, inv_freq: Tensor, num_heads: int,
    num_kv_heads: int, *, q_weight: Tensor | None = ..., k_weight: Tensor | None = ..., eps: float = ...,
    out: tuple[Tensor, Tensor, Tensor] | None = ..., impl: str = ..., cache: tuple[Tensor, Tensor, Tensor] | None = ...,
    residual: None = ..., norm_weight: Tensor | None = ..., norm_eps: float = ..., residual_out: None = ...,
) -> tuple[Tensor, Tensor, Tensor]: ...


@overload
def qkv_proj_rope(
    x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor, inv_freq: Tensor, num_heads: int,
    num_kv_heads: int, *, q_weight: Tensor | None = ..., k_weight: Tensor | None = ..., eps: float = ...,
    out: tuple[Tensor, Tensor, Tensor] | None = ..., impl: str = ..., cache: tuple[Tensor, Tensor, Tensor] | None = ...,
    residual: Tensor, norm_weight: Tensor, norm_eps: float = ..., residual_out: Tensor | None = ...,
) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


def qkv_proj_rope(
    x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor, inv_freq: Tensor, num_heads: int,
    num_kv_heads: int, *, q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 1e-6,
    out: tuple[Tensor, Tensor, Tensor] | None = None, impl: str = "fused",
    cache: tuple[Tensor, Tensor, Tensor] | None = None, residual: Tensor | None = None,
    norm_weight: Tensor | None = None, norm_eps: float = 1e-6, residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, Tensor]:
    """``q (T, H, D), k, v (T, KV, D)`` from the attention's input ``x (T, hidden)`` and its fused projection
    ``weight ((H + 2 KV) D, hidden)`` (q rows, then k, then v) and ``bias``: what
    ``qkv_norm_rope(F.linear(x, weight, bias), ...)`` returns, with the same arguments (per-head q/k norm weights,
    ``out``, ``cache``); ``impl`` picks the kernels (:mod:`bcg.ops.kernels.dispatch`).

    With ``norm_weight (hidden,)`` the projection's input is ``rms_norm(x, norm_weight, norm_eps)`` instead of
    ``x``. With ``residual (T, hidden)`` too it is ``rms_norm(x + residual)`` (the sum rounded to ``residual``'s
    dtype, as :func:`~bcg.ops.kernels.fused_add_rms_norm` rounds it), and the sum, the layer's new residual stream,
    is written to ``residual_out`` (a new tensor when None; never ``x`` or ``residual``, which are only read) and
    returned fourth: ``(q, k, v, residual_out)``. Without ``residual`` the result is ``(q, k, v)``, as it always was.

    Example:
        >>> x, w = torch.randn(5, 16), torch.randn((4 + 2 * 2) * 8, 16)
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        >>> q, k, v = qkv_proj_rope(x, w, None, torch.arange(5), inv_freq, 4, 2)
        >>> q.shape, torch.allclose(v.flatten(1), (x @ w.T)[:, 48:])
        (torch.Size([5, 4, 8]), True)
        >>> h, n = torch.randn(5, 16), torch.rand(16)
        >>> q, k, v, h2 = qkv_proj_rope(x, w, None, torch.arange(5), inv_freq, 4, 2, residual=h, norm_weight=n)
        >>> torch.equal(h2, x + h), torch.allclose(v.flatten(1), (F.rms_norm(x + h, (16,), n, 1e-6) @ w.T)[:, 48:])
        (True, True)

    Raises:
        ValueError: a prologue argument that does not fit (see :func:`_check_prologue`).
    """
    width, hidden = weight.shape
    dim = width // (num_heads + 2 * num_kv_heads)
    has_norm = q_weight is not None and k_weight is not None
    if norm_weight is not None or residual is not None or residual_out is not None:
        residual_out = _check_prologue(x, residual, norm_weight, residual_out)
    if kernel_path(impl, x) != "triton" or not is_fused(
            x, weight, bias, dim, has_norm, norm_weight=norm_weight, residual=residual, residual_out=residual_out,
    ) or (q_weight is None) != (k_weight is None):  # a lone norm weight: the two steps name the mistake
        if norm_weight is not None:  # bcg's own norm kernels first, into new buffers: x and residual stay as they are
            if residual is None:
                x = rms_norm(x, norm_weight, norm_eps, impl=impl)
            else:
                x, residual_out = fused_add_rms_norm(x, residual, norm_weight, norm_eps, out=x.new_empty(x.shape),
                                                     residual_out=residual_out, impl=impl)
        q, k, v = qkv_norm_rope(F.linear(x, weight, bias), positions, inv_freq, num_heads, num_kv_heads,
                                q_weight=q_weight, k_weight=k_weight, eps=eps, out=out, impl=impl, cache=cache)
        return (q, k, v) if residual_out is None else (q, k, v, residual_out)
    rows = x.shape[0]
    if out is None:
        out = (x.new_empty(rows, num_heads, dim), x.new_empty(rows, num_kv_heads, dim),
               x.new_empty(rows, num_kv_heads, dim))
    q_out, k_out, v_out = out
    _check(x, weight, bias, positions, inv_freq, num_heads, num_kv_heads, dim, q_out, k_out, v_out)
    if cache is not None:
        check_cache(cache, k_out)
    from bcg.ops.kernels import triton_qkv_rope

    plan = triton_qkv_rope.tiling(rows, hidden, num_heads + 2 * num_kv_heads, dim, has_norm, num_sms(x.device))
    # One split writes the outputs directly; the partials buffer is then never read, so a 1-element one stands in.
    partials = x.new_empty(triton_qkv_rope.partials_size(plan, rows, width, norm_weight is not None),
                           dtype=torch.float32)
    triton_qkv_rope.qkv_rope(x, weight, bias, positions, inv_freq, q_weight, k_weight, eps, q_out, k_out, v_out,
                             cache, partials, tile_counters(x.device, plan.tiles, "qkv_proj_rope"), plan,
                             norm_weight=norm_weight, norm_eps=norm_eps, residual=residual, residual_out=residual_out)
    return (q_out, k_out, v_out) if residual_out is None else (q_out, k_out, v_out, residual_out)


def _check_prologue(x: Tensor, residual: Tensor | None, norm_weight: Tensor | None,
                    residual_out: Tensor | None) -> Tensor | None:
    """The prologue's arguments checked, with one ``ValueError`` that names every fix; returns ``residual_out``, a
    new tensor when ``residual`` is given without one."""
    hidden = x.shape[-1]
    problems = []
    if norm_weight is None:
        problems.append("residual and residual_out are only folded in with the input RMSNorm: pass norm_weight, or "
                        "add the residual yourself")
    elif norm_weight.shape != (hidden,):
        problems.append(f"norm_weight {tuple(norm_weight.shape)} must be ({hidden},), the input RMSNorm's scale of "
                        "x's rows")
    if residual is None and residual_out is not None:
        problems.append("residual_out was given without residual: pass the residual stream x is added to, or drop "
                        "residual_out")
    if residual is not None and residual.shape != x.shape:
        problems.append(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if residual is not None and residual_out is not None:
        if residual_out.shape != residual.shape or residual_out.dtype != residual.dtype:
            problems.append(f"residual_out {tuple(residual_out.shape)} {residual_out.dtype} must have residual's "
                            f"shape and dtype, {tuple(residual.shape)} {residual.dtype}")
        elif residual_out is x or residual_out is residual or (not torch.compiler.is_compiling() and (
                _overlaps(residual_out, x) or _overlaps(residual_out, residual))):
            problems.append("residual_out overlaps x or residual (their address ranges meet), which the kernel's "
                            "other programs are still reading: pass a buffer of its own, or None for a new one")
    if problems:
        raise ValueError("qkv_proj_rope: " + "; ".join(problems))
    if residual is not None and residual_out is None:
        residual_out = residual.new_empty(residual.shape)
    return residual_out


def _overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether the address ranges ``a`` and ``b`` span in one storage meet: conservative (interleaved views that
    share no element count too), and it reads no data, so it costs no device sync."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor, inv_freq: Tensor, heads: int,
           kv_heads: int, dim: int, q_out: Tensor, k_out: Tensor, v_out: Tensor) -> None:
    rows, hidden = x.shape
    problems = []
    if weight.shape != ((heads + 2 * kv_heads) * dim, hidden):
        problems.append(f"weight {tuple(weight.shape)} is not ((H + 2*KV) * D, hidden) = "
                        f"({(heads + 2 * kv_heads) * dim}, {hidden})")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        problems.append(f"bias {tuple(bias.shape)} {bias.dtype} is not ({weight.shape[0]},) {x.dtype}")
    if q_out.shape != (rows, heads, dim) or k_out.shape != (rows, kv_heads, dim) or v_out.shape != k_out.shape:
        problems.append(f"q_out {tuple(q_out.shape)}, k_out {tuple(k_out.shape)}, v_out {tuple(v_out.shape)} are not "
                        f"({rows}, {heads}, {dim}) and twice ({rows}, {kv_heads}, {dim})")
    if positions.shape != (rows,) or inv_freq.shape != (dim // 2,):
        problems.append(f"positions {tuple(positions.shape)} and inv_freq {tuple(inv_freq.shape)} are not "
                        f"({rows},) and ({dim // 2},)")
    if any(t.stride(-1) != 1 for t in (q_out, k_out, v_out)):
        problems.append("q_out, k_out and v_out need a contiguous last dimension")
    if problems:
        raise ValueError("qkv_proj_rope: " + "; ".join(problems))
