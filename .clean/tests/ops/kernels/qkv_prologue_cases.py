"""Shared inputs and checks for the q/k/v projection kernel with the layer's input add + RMSNorm in its prologue
(``triton_qkv_rope._qkv_rope_kernel`` with ``NORM``, :mod:`bcg.ops.kernels.triton_qkv_prologue`): the interpreter
and CUDA tiers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kernel_cases import EPS, RTOL, poisoned, randn, row_view
from qkv_cases import Case
from torch import Tensor

NORM_EPS = 1e-6  # the input norm's eps, apart from the per-head norms' EPS, so that a swap of the two shows

LaunchNorm = Callable[..., None]


def direct_norm(tk, num_sms: int = 132, **tiles: int) -> LaunchNorm:
    """Calls the launcher of ``tk`` (the imported ``triton_qkv_rope``) with the prologue on its tiling for ``num_sms``
    SMs (``tiles`` override it), fresh counters and NaN partials, twice: the second launch must find the counters
    left at zero and give the same bits, the new residual included."""
    def launch(x, w, bias, positions, freqs, q_w, k_w, outs, cache, norm_weight, residual, residual_out) -> None:
        heads = w.shape[0] // outs[0].shape[2]
        plan = tk.tiling(x.shape[0], x.shape[1], heads, outs[0].shape[2], q_w is not None, num_sms, **tiles)
        size = tk.partials_size(plan, x.shape[0], w.shape[0], norm=True)
        partials = torch.full((size,), float("nan"), device=x.device)
        counters = torch.zeros(plan.tiles + 3, dtype=torch.int32, device=x.device)
        prologue = dict(norm_weight=norm_weight, norm_eps=NORM_EPS, residual=residual, residual_out=residual_out)
        tk.qkv_rope(x, w, bias, positions, freqs, q_w, k_w, EPS, *outs, cache, partials, counters, plan, **prologue)
        assert int(counters.count_nonzero()) == 0, "a tile counter was left non-zero: the next launch would misread it"
        first = [t.clone() for t in (*outs, residual_out if residual is not None else outs[0])]
        tk.qkv_rope(x, w, bias, positions, freqs, q_w, k_w, EPS, *outs, cache, partials, counters, plan, **prologue)
        again = (*outs, residual_out if residual is not None else outs[0])
        assert all(torch.equal(a, b) for a, b in zip(again, first)), "two launches on the same inputs differ"
    return launch


def reference(x: Tensor, residual: Tensor | None, norm_weight: Tensor, w: Tensor, b: Tensor | None,
              positions: Tensor, freqs: Tensor, q_w: Tensor | None, k_w: Tensor | None,
              heads: int, kv_heads: int) -> tuple[Tensor, list[Tensor]]:
    """``(h, [q, k, v])``: the sum ``h = x + residual`` as fused_add_rms_norm rounds it (fp32, then the dtype), its
    RMSNorm and the projection in fp64, the projection rounded to the dtype as ``F.linear``'s output would be, then
    ``qkv_norm_rope``'s reference."""
    from bcg.ops.kernels import qkv_norm_rope_reference

    dtype, rows, dim = x.dtype, x.shape[0], freqs.shape[0] * 2
    h = x if residual is None else (x.float() + residual.float()).to(residual.dtype)
    hd = h.double()
    normed = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + NORM_EPS) * norm_weight.double()
    qkv = normed @ w.double().T + (b.double() if b is not None else 0.0)
    refs = [torch.empty(rows, n, dim, dtype=dtype, device=x.device) for n in (heads, kv_heads, kv_heads)]
    qkv_norm_rope_reference(qkv.to(dtype), positions, freqs, q_w, k_w, EPS, *refs)
    return h, refs


def check_qkv_rope_norm(launch: LaunchNorm, device: str, dtype: torch.dtype, rows: int, hidden: int, heads: int,
                        kv_heads: int, dim: int, *, add: bool = True, qk_norm: bool = False, bias: bool = False,
                        cache: bool = False, ulps: float = 1.0, exact_residual: bool = True) -> None:
    """The prologue variant against fp64 (:func:`reference`) within two units of the scale, as
    ``qkv_cases.check_qkv_rope`` checks the kernel without it; the new residual exactly ``x + residual`` as
    fused_add_rms_norm rounds it (``exact_residual``; else within a unit), every element of it written once and
    nothing around it (a row view of a poisoned buffer); x, residual and the weights untouched; with ``cache``, k and
    v at their slots and no other cache row touched."""
    c = Case(device, dtype, rows, hidden, heads, kv_heads, dim, qk_norm=qk_norm, bias=bias, cache=cache)
    x, w, b = c.x, c.w, c.b
    residual = row_view(rows, hidden, dtype=dtype, device=device, seed=rows + 7, pad=4).mul_(4) if add else None
    x[0].mul_(2**-10)  # a quiet row (mean square ~1e-5): its rstd shows which eps the input norm used
    if add:
        residual[0].mul_(2**-10)
    norm_weight = randn(hidden, dtype=dtype, device=device, seed=11, scale=0.3) + 1
    inputs = [t for t in (x, residual, norm_weight, w, c.positions, c.freqs) if t is not None]
    saved = [t.clone() for t in inputs]
    res_buf = poisoned(rows + 2, hidden + 5, dtype=dtype, device=device)
    residual_out = res_buf[:rows, 3:3 + hidden]
    launch(x, w, b, c.positions, c.freqs, c.q_w, c.k_w, c.outs, c.cache_args, norm_weight, residual, residual_out)
    assert all(torch.equal(t, t0) for t, t0 in zip(inputs, saved)), "an input changed"
    c.assert_nothing_around_the_outputs()
    h, refs = reference(x, residual, norm_weight, w, b, c.positions, c.freqs, c.q_w, c.k_w, heads, kv_heads)
    if add:
        assert not residual_out.isnan().any(), "an element of the new residual was not written"
        around = res_buf.clone()
        around[:rows, 3:3 + hidden] = float("nan")
        assert around.isnan().all(), "wrote outside residual_out"
        if exact_residual:
            assert torch.equal(residual_out, h), "the new residual differs from x + residual rounded once"
        else:  # Triton's interpreter truncates fp32 -> bf16 where the compiled kernel rounds to nearest
            torch.testing.assert_close(residual_out.double(), h.double(), rtol=RTOL[dtype], atol=0.0)
    else:
        assert res_buf.isnan().all(), "wrote a residual without the add"
    c.assert_outputs(refs, 2 * RTOL[dtype] * ulps)
