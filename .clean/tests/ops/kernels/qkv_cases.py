"""Shared inputs and checks for :func:`bcg.ops.kernels.qkv_proj_rope`, the q/k/v projection with RoPE in its epilogue
(the interpreter and CUDA tiers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kernel_cases import EPS, RTOL, gen, inv_freq, poisoned, randn, row_view
from torch import Tensor

# (rows, hidden, heads, kv_heads, head_dim): odd sizes, one row, more rows than a 16-row tile, head sizes of 32, 64
# and 128 (one, two and four 16-pair blocks a half head); the llama shapes too on CUDA.
SHAPES = [(5, 96, 4, 2, 32), (1, 64, 2, 1, 64), (17, 80, 3, 1, 32), (3, 130, 2, 2, 128), (33, 200, 2, 1, 64)]
LLAMA_SHAPES = [(64, 1024, 16, 4, 64), (64, 2048, 32, 8, 64), (16, 2048, 16, 4, 128), (64, 1024, 16, 8, 128)]

Launch = Callable[..., None]


def direct(tk, num_sms: int = 132, **tiles: int) -> Launch:
    """Calls the launcher of ``tk`` (the imported ``triton_qkv_rope``) on its tiling for ``num_sms`` SMs (``tiles``
    override it) with fresh counters, launching twice: the second launch must find the counters left at zero and
    give the same bits (the partials are summed in a fixed order)."""
    def launch(x, w, bias, positions, freqs, q_w, k_w, outs, cache) -> None:
        heads = w.shape[0] // outs[0].shape[2]
        plan = tk.tiling(x.shape[0], x.shape[1], heads, outs[0].shape[2], q_w is not None, num_sms, **tiles)
        partials = torch.full((max(1, plan.split_k * x.shape[0] * w.shape[0]),), float("nan"), device=x.device)
        counters = torch.zeros(plan.tiles + 3, dtype=torch.int32, device=x.device)
        tk.qkv_rope(x, w, bias, positions, freqs, q_w, k_w, EPS, *outs, cache, partials, counters, plan)
        assert int(counters.count_nonzero()) == 0, "a tile counter was left non-zero: the next launch would misread it"
        first = [o.clone() for o in outs]
        tk.qkv_rope(x, w, bias, positions, freqs, q_w, k_w, EPS, *outs, cache, partials, counters, plan)
        assert all(torch.equal(a, b) for a, b in zip(outs, first)), "two launches on the same inputs differ"
    return launch


def check_qkv_rope(launch: Launch, device: str, dtype: torch.dtype, rows: int, hidden: int, heads: int,
                   kv_heads: int, dim: int, *, qk_norm: bool = False, bias: bool = False, cache: bool = False,
                   ulps: float = 1.0) -> None:
    """The kernel against the two steps: the projection computed in fp64 and rounded to the dtype as ``F.linear``'s
    output would be, then ``qkv_norm_rope``'s reference; within two units of the scale (the projection's sums run in
    another order, so an element may round the other way), every output element written and nothing past the
    outputs (bridge-like strided views of poisoned buffers), the inputs untouched; with ``cache``, k and v as written
    at their slots and no other cache row touched."""
    from bcg.ops.kernels import qkv_norm_rope_reference

    c = Case(device, dtype, rows, hidden, heads, kv_heads, dim, qk_norm=qk_norm, bias=bias, cache=cache)
    x, w, b = c.x, c.w, c.b
    inputs = [t.clone() for t in (x, w, c.positions, c.freqs)]
    launch(x, w, b, c.positions, c.freqs, c.q_w, c.k_w, c.outs, c.cache_args)
    assert all(torch.equal(t, t0) for t, t0 in zip((x, w, c.positions, c.freqs), inputs)), "an input changed"
    c.assert_nothing_around_the_outputs()
    qkv = x.double() @ w.double().T + (b.double() if bias else 0.0)
    refs = [torch.empty(rows, n, dim, dtype=dtype, device=device) for n in (heads, kv_heads, kv_heads)]
    qkv_norm_rope_reference(qkv.to(dtype), c.positions, c.freqs, c.q_w, c.k_w, EPS, *refs)
    c.assert_outputs(refs, 2 * RTOL[dtype] * ulps)


class Case:
    """One q/k/v kernel case's inputs (a strided row view of ``x``, the weight, bias, positions, frequencies, per-head
    norm weights), its outputs (row views of NaN-poisoned buffers) and, with ``cache``, a poisoned K/V pool and the
    slots to write: what the kernel's checks with and without the input-norm prologue share."""

    def __init__(self, device: str, dtype: torch.dtype, rows: int, hidden: int, heads: int, kv_heads: int, dim: int,
                 *, qk_norm: bool, bias: bool, cache: bool) -> None:
        width = (heads + 2 * kv_heads) * dim
        self.rows, self.heads, self.kv_heads = rows, heads, kv_heads
        self.x = row_view(rows, hidden, dtype=dtype, device=device, seed=hidden + rows, pad=8)
        self.w = randn(width, hidden, dtype=dtype, device=device, seed=width, scale=hidden**-0.5)
        self.b = randn(width, dtype=dtype, device=device, seed=3, scale=0.5) if bias else None
        self.positions = torch.randint(0, 8192, (rows,), generator=gen(rows)).to(device)
        self.freqs = inv_freq(dim, 500000.0, device)
        self.q_w = randn(dim, dtype=dtype, device=device, seed=5, scale=0.3) + 1 if qk_norm else None
        self.k_w = randn(dim, dtype=dtype, device=device, seed=6, scale=0.3) + 1 if qk_norm else None
        self.bufs = [poisoned(rows + 3, n + 1, dim, dtype=dtype, device=device) for n in (heads, kv_heads, kv_heads)]
        self.outs = [buf[:rows, :-1] for buf in self.bufs]
        self.num_slots = 2 * rows + 3
        self.caches = [poisoned(self.num_slots, kv_heads, dim, dtype=dtype, device=device)
                       for _ in range(2)] if cache else None
        self.slots = torch.randperm(self.num_slots, generator=gen(rows + 1))[:rows].to(device)

    @property
    def cache_args(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The launcher's ``cache`` argument: ``(k_cache, v_cache, slots)`` or None."""
        return (*self.caches, self.slots) if self.caches else None

    def assert_nothing_around_the_outputs(self) -> None:
        assert all(buf[self.rows:].isnan().all() and buf[:, -1].isnan().all() for buf in self.bufs), \
            "wrote outside the outputs"

    def assert_outputs(self, refs: list[Tensor], tol: float) -> None:
        assert_outputs(self.outs, refs, self.caches, self.slots, self.num_slots, tol)


def assert_outputs(outs: list[Tensor], refs: list[Tensor], caches: list[Tensor], slots: Tensor, num_slots: int,
                   tol: float) -> None:
    """q, k and v within ``tol`` of their references and every element written; with ``caches``, the K/V rows at
    ``slots`` are k and v exactly and no other row of the pool was written."""
    for got, ref, name in zip(outs, refs, "qkv"):
        assert not got.isnan().any(), f"{name}: an element was not written"
        torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol * float(ref.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    if caches:
        assert torch.equal(caches[0][slots], outs[1]) and torch.equal(caches[1][slots], outs[2]), "cache rows differ"
        others = torch.ones(num_slots, dtype=torch.bool, device=slots.device)
        others[slots] = False
        assert all(c[others].isnan().all() for c in caches), "wrote cache rows other than the slots"


def model_inputs(rows: int, hidden: int, heads: int, kv_heads: int, dim: int, device: str,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x, weight, positions, inv_freq`` as a model passes them (contiguous ``x``)."""
    x = randn(rows, hidden, dtype=dtype, device=device, seed=rows)
    w = randn((heads + 2 * kv_heads) * dim, hidden, dtype=dtype, device=device, seed=1, scale=hidden**-0.5)
    return x, w, torch.arange(rows, device=device) + 7, inv_freq(dim, 10000.0, device)
