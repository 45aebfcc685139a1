"""Shared inputs and checks for the MLP's one-kernel fusions, :func:`bcg.ops.kernels.swiglu_down` and
:func:`bcg.ops.kernels.gate_up_silu` (the interpreter and CUDA tiers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kernel_cases import RTOL, randn, row_view
from torch import Tensor

# (rows, cols, inner, SMs): no split, splits of a few and of many K steps, odd sizes in every dimension, one row,
# more rows than a 64-row tile, and the two llama shapes' down projections.
SHAPES = [(5, 96, 200, 132), (64, 128, 512, 4), (3, 64, 1000, 132), (33, 70, 300, 132), (1, 512, 1400, 132),
          (100, 200, 700, 16)]
LLAMA_SHAPES = [(64, 1024, 2816, 132), (64, 2048, 8192, 132), (16, 1024, 2816, 132), (128, 2048, 8192, 132)]

Launch = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]


def direct(tk) -> Launch:
    """Calls the launcher of ``tk`` (the imported ``triton_down_proj``) with ``num_sms`` SMs' tiling and fresh
    counters; returns the output and the counters."""
    def launch(x: Tensor, w: Tensor, num_sms: int) -> tuple[Tensor, Tensor]:
        rows, cols = x.shape[0], w.shape[0]
        plan = tk.tiling(rows, cols, w.shape[1], num_sms)
        out = torch.full((rows, cols), float("nan"), dtype=x.dtype, device=x.device)
        partials = torch.full((max(1, plan.split_k * rows * cols),), float("nan"), device=x.device)
        counters = torch.zeros(plan.tiles + 3, dtype=torch.int32, device=x.device)
        tk.swiglu_down(x, w, out, partials, counters, plan)
        return out, counters
    return launch


def inputs(rows: int, cols: int, inner: int, dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor]:
    """Row-strided ``gate_up (rows, 2 inner)`` and a ``weight (cols, inner)`` scaled as a trained layer's."""
    x = row_view(rows, 2 * inner, dtype=dtype, device=device, seed=inner + rows, pad=8)
    return x, randn(cols, inner, dtype=dtype, device=device, seed=cols, scale=inner**-0.5)


def check_swiglu_down(launch: Launch, device: str, dtype: torch.dtype, rows: int, cols: int, inner: int,
                      num_sms: int, ulps: float = 1.0) -> None:
    """The kernel against the two steps computed in fp64 from the activation as eager torch rounds it: within two
    units of the output's scale (the sums run in another order), every element written, the input untouched, every
    counter back at zero, and a second launch giving the same bits (the partials are summed in a fixed order)."""
    from bcg.ops.kernels import silu_and_mul_reference

    x, w = inputs(rows, cols, inner, dtype, device)
    x0 = x.clone()
    out, counters = launch(x, w, num_sms)
    assert torch.equal(x, x0), "swiglu_down changed its input"
    assert not out.isnan().any(), "an output element was not written"
    assert int(counters.count_nonzero()) == 0, "a tile counter was left non-zero: the next launch would misread it"
    ref = silu_and_mul_reference(x).double() @ w.double().T
    tol = 2 * RTOL[dtype] * ulps * float(ref.abs().max())
    torch.testing.assert_close(out.double(), ref, rtol=2 * RTOL[dtype] * ulps, atol=tol)
    again, _ = launch(x, w, num_sms)
    assert torch.equal(again, out), "two launches on the same inputs differ"


# (rows, hidden, inter, SMs) of gate_up_silu: odd sizes, one row, 16-, 64- and 128-row tiles; the llama shapes too on
# CUDA (the interpreter takes seconds a case there).
GATE_UP_SHAPES = [(5, 96, 200, 132), (1, 64, 64, 132), (33, 70, 130, 4), (16, 256, 640, 132), (100, 200, 300, 16)]
GATE_UP_LLAMA_SHAPES = [(64, 1024, 2816, 132), (16, 2048, 8192, 132)]
# The same with the RMSNorm folded in (BCG_NORM_FUSION): one row, 16- and 64-row tiles, hidden sizes that are no
# multiple of the 128-wide K step; on CUDA the llama MLPs of hidden 2048 and 3072 too.
GATE_UP_NORM_SHAPES = [(1, 200, 96, 132), (16, 96, 130, 132), (64, 300, 70, 4), (33, 64, 64, 132)]
GATE_UP_NORM_LLAMA_SHAPES = [(r, h, 8192, 132) for h in (2048, 3072) for r in (16, 64)]

GateUpLaunch = Callable[..., Tensor]


def direct_gate_up(tk) -> GateUpLaunch:
    """Calls the launcher of ``tk`` (the imported ``triton_gate_up``) with ``num_sms`` SMs' tiling (and the norm's
    weight to fold, when given)."""
    def launch(x: Tensor, w: Tensor, num_sms: int, norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
        out = torch.full((x.shape[0], w.shape[0] // 2), float("nan"), dtype=x.dtype, device=x.device)
        tk.gate_up_silu(x, w, out, tk.tiling(x.shape[0], w.shape[0] // 2, num_sms), norm_weight, eps)
        return out
    return launch


def check_gate_up_silu(launch: GateUpLaunch, device: str, dtype: torch.dtype, rows: int, hidden: int, inter: int,
                       num_sms: int, ulps: float = 1.0, norm: bool = False) -> None:
    """The kernel against the two steps: the projection computed in fp64 and rounded to the dtype as its output
    would be, then SiLU-and-multiply as eager torch rounds it; within two units of the scale (the projection's sums
    run in another order, and a gate that rounds the other way moves its product by a unit), every element written,
    the input untouched. With ``norm`` the rows (each of its own scale, so each has its own ``rstd``) are RMSNorm'ed
    in fp64 before the projection: the kernel's one rounding of ``x * w_norm`` stays within the same bound."""
    import torch.nn.functional as F

    from bcg.ops.kernels import silu_and_mul_reference

    x = row_view(rows, hidden, dtype=dtype, device=device, seed=hidden + rows, pad=8)
    w = randn(2 * inter, hidden, dtype=dtype, device=device, seed=inter, scale=hidden**-0.5)
    kw = {}
    if norm:
        x.mul_(torch.linspace(0.25, 6.0, rows, device=device)[:, None].to(dtype))  # in place: the view's row stride
        kw = {"norm_weight": 1 + randn(hidden, dtype=dtype, device=device, seed=hidden, scale=0.2), "eps": 1e-5}
    x0 = x.clone()
    out = launch(x, w, num_sms, **kw)
    assert torch.equal(x, x0), "gate_up_silu changed its input"
    assert not out.isnan().any(), "an output element was not written"
    rows64 = F.rms_norm(x.double(), (hidden,), kw["norm_weight"].double(), kw["eps"]) if norm else x.double()
    ref = silu_and_mul_reference((rows64 @ w.double().T).to(dtype)).double()
    tol = 2 * RTOL[dtype] * ulps
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
