"""Shared inputs and comparisons for the fused-kernel tests (reference, interpreter and CUDA tiers)."""

from __future__ import annotations

import torch
from torch import Tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Relative tolerance per dtype: two units in the last place of a half-precision output, the most a different
# rounding of an fp32 intermediate (reduction order, rsqrt, exp, sin/cos) can move a result.
# fp32 results carry the error of a different reduction order (rows of thousands of elements, sums of k products
# with cancellation), so fp32 gets about 2^-17 rather than a few units.
RTOL = {torch.bfloat16: 2 * 2**-8, torch.float16: 2 * 2**-11, torch.float32: 2**-17}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> Tensor:
    """Seeded normal samples made on the CPU (the same numbers on every device), moved to ``device``."""
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype=dtype, device=device)


def row_view(rows: int, cols: int, *, dtype: torch.dtype, device: str, seed: int, pad: int = 24) -> Tensor:
    """A ``(rows, cols)`` view with a row stride of ``cols + pad``: a slice of a wider tensor, as models pass."""
    return randn(rows, cols + pad, dtype=dtype, device=device, seed=seed)[:, pad:]


def poisoned(*shape: int, dtype: torch.dtype, device: str) -> Tensor:
    """An output buffer full of NaN (or -1 for integers), so an element a kernel forgets to write shows."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def inv_freq(head_dim: int, theta: float = 10000.0, device: str = "cpu") -> Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return (1.0 / theta**exponents).to(device)


def assert_matches(got: Tensor, ref: Tensor, *, min_exact: float | None = None, rtol_ulps: float = 1.0,
                   what: str = "") -> float:
    """``got`` equals ``ref`` within the dtype's tolerance (scaled by ``rtol_ulps``), is finite wherever ``ref``
    is, and (with ``min_exact``) agrees bit for bit on at least about that fraction of elements. Returns the
    fraction."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"{what}: {got.shape}/{got.dtype} vs {ref.shape}/{ref.dtype}")
    if got.numel() == 0:
        return 1.0
    assert not (got.isnan() & ~ref.isnan()).any(), f"{what}: NaN where the reference has a number (unwritten?)"
    rtol = RTOL[got.dtype] * rtol_ulps
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=rtol, msg=lambda m: f"{what}: {m}")
    exact = (got == ref).float().mean().item()
    if min_exact is not None:  # a fraction, but never fewer than two misses allowed (small tensors)
        misses, allowed = round((1 - exact) * got.numel()), max(2.0, (1 - min_exact) * got.numel())
        assert misses <= allowed, f"{what}: {misses} of {got.numel()} elements differ in bits (allowed {allowed:.0f})"
    return exact


# --- Checks shared by the interpreter and CUDA tiers. `run` adapts one tier's way of calling a kernel; every check
# poisons the outputs, compares with the reference and verifies that the inputs were not touched. ---

EPS = 1e-5


def _match(run, got: Tensor, ref: Tensor, min_exact: float | None, what: str, ulps: float = 1.0) -> float:
    """:func:`assert_matches` widened by the tier's ``run.ulps[dtype]`` (the interpreter truncates bf16)."""
    return assert_matches(got, ref, min_exact=min_exact, what=what, rtol_ulps=ulps * run.ulps.get(got.dtype, 1.0))


def check_rms_norm(run, device: str, dtype: torch.dtype, rows: int, hidden: int, min_exact: float | None) -> float:
    from bcg.ops.kernels import rms_norm_reference

    x = row_view(rows, hidden, dtype=dtype, device=device, seed=rows + hidden)
    w = randn(hidden, dtype=dtype, device=device, seed=1, scale=0.5) + 1
    x0 = x.clone()
    out = poisoned(rows, hidden, dtype=dtype, device=device)
    run.rms_norm(x, w, EPS, out)
    assert torch.equal(x, x0), "rms_norm changed its input"
    return _match(run, out, rms_norm_reference(x, w, EPS), min_exact, "rms_norm")


def check_add_rms_norm(run, device: str, dtype: torch.dtype, rows: int, hidden: int, min_exact: float | None,
                       exact_residual: bool = True, in_place: bool = True) -> float:
    from bcg.ops.kernels import rms_norm_reference

    x = randn(rows, hidden, dtype=dtype, device=device, seed=2)
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=3, scale=4.0)
    w = randn(hidden, dtype=dtype, device=device, seed=4, scale=0.5) + 1
    expected_residual = residual + x  # `hidden = hidden + attn_out`
    expected = rms_norm_reference(expected_residual, w, EPS)
    if in_place:  # x <- normed, residual <- sum
        run.add_rms_norm(x, residual, w, EPS, x, residual)
        out, residual_out = x, residual
    else:
        x0, residual0 = x.clone(), residual.clone()
        out, residual_out = poisoned(rows, hidden, dtype=dtype, device=device), poisoned(rows, hidden, dtype=dtype,
                                                                                        device=device)
        run.add_rms_norm(x, residual, w, EPS, out, residual_out)
        assert torch.equal(x, x0) and torch.equal(residual, residual0), "an input changed"
    if exact_residual:
        assert torch.equal(residual_out, expected_residual), "the residual differs from `residual + x`"
    else:
        _match(run, residual_out, expected_residual, None, "residual")
    return _match(run, out, expected, min_exact, "fused_add_rms_norm")


def check_add_rms_norm_partials(run, device: str, dtype: torch.dtype, rows: int, hidden: int, parts: int,
                                min_exact: float | None) -> float:
    """The add + norm over a split-K GEMM's fp32 partials ``(parts, rows, hidden)``: summed in order, added to the
    residual, rounded once (``add_partials``); the partials are only read."""
    from bcg.ops.kernels import add_partials, rms_norm_reference

    x = randn(parts, rows, hidden, dtype=torch.float32, device=device, seed=5)
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=6, scale=4.0)
    w = randn(hidden, dtype=dtype, device=device, seed=7, scale=0.5) + 1
    x0, residual0 = x.clone(), residual.clone()
    expected_residual = add_partials(x, residual)
    out, residual_out = poisoned(rows, hidden, dtype=dtype, device=device), poisoned(rows, hidden, dtype=dtype,
                                                                                    device=device)
    run.add_rms_norm(x, residual, w, EPS, out, residual_out)
    assert torch.equal(x, x0) and torch.equal(residual, residual0), "an input changed"
    _match(run, residual_out, expected_residual, min_exact, "residual + partials")
    return _match(run, out, rms_norm_reference(expected_residual, w, EPS), min_exact, "fused_add_rms_norm(partials)")


def check_silu_and_mul(run, device: str, dtype: torch.dtype, rows: int, inter: int, min_exact: float | None) -> float:
    from bcg.ops.kernels import silu_and_mul_reference

    x = row_view(rows, 2 * inter, dtype=dtype, device=device, seed=inter, pad=8)
    x0 = x.clone()
    out = poisoned(rows, inter, dtype=dtype, device=device)
    run.silu_and_mul(x, out)
    assert torch.equal(x, x0), "silu_and_mul changed its input"
    return _match(run, out, silu_and_mul_reference(x), min_exact, "silu_and_mul")


def check_qkv_norm_rope(run, device: str, dtype: torch.dtype, rows: int, heads: int, kv_heads: int, dim: int,
                        qk_norm: bool, min_exact: float | None) -> float:
    from bcg.ops.kernels import qkv_norm_rope_reference

    qkv = row_view(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, seed=dim + heads)
    positions = torch.randint(0, 8192, (rows,), generator=gen(rows)).to(device)
    freqs = inv_freq(dim, 150000.0, device)
    q_w = randn(dim, dtype=dtype, device=device, seed=5, scale=0.3) + 1 if qk_norm else None
    k_w = randn(dim, dtype=dtype, device=device, seed=6, scale=0.3) + 1 if qk_norm else None
    inputs = [t.clone() for t in (qkv, positions, freqs)]
    # Outputs as bridge views: row-sliced, head-strided views of wider poisoned buffers.
    bufs = [poisoned(rows + 3, n + 1, dim, dtype=dtype, device=device) for n in (heads, kv_heads, kv_heads)]
    outs = [b[:rows, :-1] for b in bufs]
    refs = [torch.empty(rows, n, dim, dtype=dtype, device=device) for n in (heads, kv_heads, kv_heads)]
    run.qkv_norm_rope(qkv, positions, freqs, q_w, k_w, EPS, *outs)
    qkv_norm_rope_reference(qkv, positions, freqs, q_w, k_w, EPS, *refs)
    assert all(torch.equal(t, t0) for t, t0 in zip((qkv, positions, freqs), inputs)), "an input changed"
    assert all(b[rows:].isnan().all() and b[:, -1].isnan().all() for b in bufs), "wrote outside the outputs"
    assert torch.equal(outs[2], refs[2]), "v is not an exact copy"
    return min(_match(run, o, r, min_exact, name, 2.0)
               for o, r, name in zip(outs[:2], refs[:2], ("q", "k")))


def check_qkv_norm_rope_cache(run, device: str, dtype: torch.dtype, rows: int, heads: int, kv_heads: int,
                              dim: int) -> None:
    """With a cache, k and v as written land at their slots of the caches too, and nowhere else."""
    qkv = row_view(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, seed=dim + rows)
    positions = torch.randint(0, 8192, (rows,), generator=gen(rows)).to(device)
    freqs = inv_freq(dim, 10000.0, device)
    outs = [poisoned(rows, n, dim, dtype=dtype, device=device) for n in (heads, kv_heads, kv_heads)]
    num_slots = 2 * rows + 3
    caches = [poisoned(num_slots, kv_heads, dim, dtype=dtype, device=device) for _ in range(2)]
    slots = torch.randperm(num_slots, generator=gen(rows + 1))[:rows].to(device)
    run.qkv_norm_rope(qkv, positions, freqs, None, None, EPS, *outs, cache=(*caches, slots))
    assert torch.equal(caches[0][slots], outs[1]) and torch.equal(caches[1][slots], outs[2]), "cache rows differ"
    others = torch.ones(num_slots, dtype=torch.bool, device=device)
    others[slots] = False
    assert all(c[others].isnan().all() for c in caches), "wrote cache rows other than the slots"


def check_router_topk(run, device: str, dtype: torch.dtype, rows: int, experts: int, top_k: int,
                      renormalize: bool, min_exact: float | None, rule: str = "softmax_topk", bias: bool = False,
                      n_group: int = 1, topk_group: int = 1, scaling: float = 1.0, num_shared: int = 0) -> float:
    """One router rule against its reference: the ids select the same choice scores (in the same order where no two
    of the top k + 1 tie), the shared columns follow, and the weights match to the dtype's rounding."""
    from bcg.ops.kernels import router_topk_reference
    from bcg.ops.kernels.moe_router import _best_groups_only

    logits = row_view(rows, experts, dtype=dtype, device=device, seed=experts + rows, pad=3)
    correction = randn(experts, dtype=torch.float32, device=device, seed=11, scale=0.3) if bias else None
    out_dtype = torch.float32 if rule == "sigmoid_topk" else dtype  # as the routers return them
    rule_args = dict(rule=rule, correction_bias=correction, n_group=n_group, topk_group=topk_group, scaling=scaling,
                     num_shared=num_shared)
    logits0 = logits.clone()
    weights, ids = run.router_topk(logits, top_k, renormalize, out_dtype, **rule_args)
    ref_w, ref_ids = router_topk_reference(logits, top_k, renormalize, out_dtype, *rule_args.values())
    assert torch.equal(logits, logits0) and ids.dtype == torch.int64 and ids.shape == (rows, top_k + num_shared)
    if rule == "softmax_topk":
        choice = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif rule == "topk_softmax":
        choice = logits.float()
    else:
        scores = logits.float().sigmoid()
        choice = _best_groups_only(scores if correction is None else scores + correction, n_group, topk_group)
    # Ids must select the same choice scores; where scores tie torch.topk's order is unspecified.
    routed, ref_routed = ids[:, :top_k], ref_ids[:, :top_k]
    torch.testing.assert_close(choice.gather(1, routed), choice.gather(1, ref_routed), rtol=0, atol=0)
    top = choice.sort(dim=-1, descending=True).values[:, : top_k + 1]
    untied = (top[:, 1:] != top[:, :-1]).all(dim=1)
    assert torch.equal(routed[untied], ref_routed[untied])
    assert torch.equal(ids[:, top_k:], ref_ids[:, top_k:]), "the shared experts' columns differ"
    exact = min_exact if out_dtype == dtype else None  # fp32 weights carry any fp32 difference (exp, sum order)
    return _match(run, weights[untied], ref_w[untied], exact, "router weights")


def random_topk_ids(rows: int, experts: int, top_k: int, device: str, seed: int, dtype=torch.int64) -> Tensor:
    """Distinct expert ids per row, as a router produces (skewed so some experts get no rows)."""
    scores = torch.rand(rows, experts, generator=gen(seed)) * torch.linspace(0.2, 1.0, experts)
    return scores.topk(top_k, dim=-1).indices.to(device=device, dtype=dtype)


def check_expert_order(run, device: str, rows: int, experts: int, top_k: int, ids_dtype=torch.int64) -> None:
    from bcg.ops.kernels import expert_order_reference

    ids = random_topk_ids(rows, experts, top_k, device, seed=rows + experts, dtype=ids_dtype)
    ids0 = ids.clone()
    got = run.expert_order(ids, experts)
    ref = expert_order_reference(ids, experts)
    assert torch.equal(ids, ids0)
    for name, g, r in zip(ref._fields, got, ref):
        assert g.dtype == r.dtype and torch.equal(g, r), f"expert_order.{name} differs from the stable sort"


def check_moe_combine(run, device: str, dtype: torch.dtype, rows: int, hidden: int, top_k: int,
                      min_exact: float | None, bias: bool = False) -> float:
    """The combine against its reference; with ``bias``, each row plus its expert's output bias (gpt-oss's down
    bias), which the kernel adds in fp32 where the reference adds in the rows' dtype (one rounding more)."""
    from bcg.ops.kernels import moe_combine_reference

    y = row_view(rows * top_k, hidden, dtype=dtype, device=device, seed=hidden, pad=16)
    slot = torch.randperm(rows * top_k, generator=gen(rows)).view(rows, top_k).to(device)
    weights = torch.rand(rows, top_k, generator=gen(7)).to(dtype=dtype, device=device)
    extra = {}
    if bias:
        extra = {"bias": randn(5, hidden, dtype=dtype, device=device, seed=11),
                 "row_expert": torch.randint(0, 5, (rows * top_k,), generator=gen(3)).to(device)}
    inputs = [t.clone() for t in (y, slot, weights, *extra.values())]
    out = poisoned(rows, hidden, dtype=dtype, device=device)
    run.moe_combine(y, slot, weights, out, **extra)
    assert all(torch.equal(t, t0) for t, t0 in zip((y, slot, weights, *extra.values()), inputs)), "an input changed"
    if bias:  # the kernel adds the bias in fp32: the reference in fp32, rounded once, is what it computes
        want = moe_combine_reference(y.float(), slot, weights.float(), extra["bias"].float(), extra["row_expert"])
        return _match(run, out, want.to(dtype), min_exact, "moe_combine with bias")
    return _match(run, out, moe_combine_reference(y, slot, weights), min_exact, "moe_combine")


def check_clamped_swiglu(run, device: str, dtype: torch.dtype, rows: int, inter: int, experts: int, bias: bool,
                         min_exact: float | None) -> float:
    """gpt-oss's activation with each row's expert bias: values on both sides of the clamps, untouched inputs."""
    from bcg.ops.kernels import clamped_swiglu_reference

    x = row_view(rows, 2 * inter, dtype=dtype, device=device, seed=inter + rows, pad=8) * 5
    b = randn(experts, 2 * inter, dtype=dtype, device=device, seed=3) if bias else None
    expert = torch.randint(0, experts, (rows,), generator=gen(rows)).to(device)
    inputs = [t.clone() for t in (x, expert)]
    out = poisoned(rows, inter, dtype=dtype, device=device)
    run.clamped_swiglu(x, b, expert, 1.702, 7.0, out)
    assert all(torch.equal(t, t0) for t, t0 in zip((x, expert), inputs)), "an input changed"
    ref = clamped_swiglu_reference(x, b, expert, 1.702, 7.0)
    if run.ulps.get(dtype, 1.0) > 1.0 and rows:
        # A tier that truncates (the interpreter's bf16) moves one of the six roundings by a unit, and ``up + 1``
        # cancels near up = -1: there the error is a unit of the row's scale, not of the element.
        assert not out.isnan().any(), "clamped_swiglu: NaN (unwritten?)"
        assert (out.float() - ref.float()).abs().max() <= 4 * RTOL[dtype] * ref.float().abs().max()
        return 0.0
    return _match(run, out, ref, min_exact, "clamped_swiglu")


def index_topk_inputs(device: str, dtype: torch.dtype, q_lens: list[int], prefix: list[int], heads: int, dim: int,
                      pad: int, seed: int, ties: bool = False) -> tuple:
    """A packed DSA batch: index queries and weights ``(T_pad, ...)``, an index-key pool with the requests' keys at
    scattered slots, ``read_slots``, ``cu_seqlens_q/k``, ``num_tokens``, ``max_seqlen_k``. With ``ties`` every dot
    product is negative, so every score is a (signed) zero: the ranking is all ties, broken by key order."""
    g = gen(seed)
    num_tokens, k_lens = sum(q_lens), [a + b for a, b in zip(q_lens, prefix)]
    slots = sum(k_lens) + 17
    read_slots = torch.randperm(slots, generator=g)[: sum(k_lens)]
    q = torch.randn(num_tokens + pad, heads, dim, generator=g)
    pool = torch.randn(slots, dim, generator=g)
    if ties:
        q, pool = -q.abs(), pool.abs()
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (q_lens, k_lens)]
    to = dict(dtype=dtype, device=device)
    return (q.to(**to), torch.randn(num_tokens + pad, heads, generator=g).to(**to), pool.to(**to),
            read_slots.to(device), cu[0].to(device), cu[1].to(device), num_tokens, max(k_lens))


def check_index_topk(run, device: str, dtype: torch.dtype, q_lens: list[int], prefix: list[int], heads: int,
                     dim: int, topk: int, ties: bool = False, seed: int = 0) -> None:
    """The fused DSA top-k against the reference: the same picks in the same order, or, where fp32 sums in another
    order swap two keys, picks of the same scores (a near tie); -1 exactly where the reference has it."""
    from bcg.ops.kernels.dsa_topk import index_topk_reference

    args = index_topk_inputs(device, dtype, q_lens, prefix, heads, dim, pad=3, seed=seed, ties=ties)
    got = run.index_topk(*args, topk).cpu()
    cpu = [a.cpu() if isinstance(a, Tensor) else a for a in args]
    q, w, pool, read_slots, cu_q, cu_k, num_tokens, _ = cpu
    ref = index_topk_reference(q.float(), w.float(), pool, read_slots, cu_q, cu_k, num_tokens, topk)
    assert got.shape == ref.shape and got.dtype == torch.int64
    assert torch.equal(got < 0, ref < 0), "picks missing or extra against the reference"
    if torch.equal(got, ref):
        return
    # every slot's score for every row (fp32, the reference's formula); a differing pick must be a near tie
    scores = torch.einsum("qhd,sd->qhs", q.float(), pool.float()).relu().mul(w.float()[:, :, None]).sum(1)
    picked, wanted = (scores.gather(1, t.clamp_min(0)) for t in (got, ref))
    torch.testing.assert_close(picked[ref >= 0], wanted[ref >= 0], rtol=1e-5, atol=1e-5)
    assert (got != ref).float().mean() < 0.05, "more than a few near-tie swaps"
