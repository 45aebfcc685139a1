"""FlashAttention varlen's reference: the kernel's numbers (per sequence, bottom-right causal, windows, GQA, the
log-sum-exp) and the kernel's refusals, including the one-query GQA reshape that crashed the serving soak."""

from __future__ import annotations

import math

import pytest
import torch

from bcg.emulation import EmulatedGraph
from bcg.ops.flash_reference import reference_flash_varlen

BF16 = torch.bfloat16


def _packed(lens_q, lens_k, heads=4, kv_heads=2, dim=16, seed=0, extra_q=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q) + extra_q, heads, dim, generator=gen).to(BF16)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(BF16)
    v = torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(BF16)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _naive(q, k, v, lens_q, lens_k, causal, left=-1, right=-1, scale=None):
    """Per sequence in double: query i sees key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right."""
    outs, lses, q0, k0 = [], [], 0, 0
    group = q.shape[1] // k.shape[1]
    for lq, lk in zip(lens_q, lens_k):
        qs = q[q0 : q0 + lq].double()
        ks = k[k0 : k0 + lk].double().repeat_interleave(group, 1)
        vs = v[k0 : k0 + lk].double().repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * (scale or q.shape[-1] ** -0.5)
        i, j = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None]
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if causal or right >= 0:
            seen &= j <= i + (0 if causal else right)
        if left >= 0:
            seen &= j >= i - left
        logits = logits.masked_fill(~seen, -math.inf)
        lse = torch.logsumexp(logits, -1)
        probs = torch.where(seen.any(-1)[:, None], torch.exp(logits - lse[..., None]), 0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        lses.append(torch.where(seen.any(-1), lse, math.inf))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


CASES = {
    "self": ([5, 1, 9], [5, 1, 9], {}),
    "prefixes": ([4, 1, 7], [7, 1, 17], {}),
    "empty-sequences": ([3, 0, 2, 0], [3, 0, 6, 0], {}),
    "more-queries-than-keys": ([4], [2], {}),  # the first rows see nothing: 0 and +inf
    "window": ([6, 3], [9, 3], dict(window_size_left=2)),
    "scale": ([3, 2], [5, 2], dict(scale=0.3)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_the_kernels_definition(case, heads, kv_heads):
    lens_q, lens_k, kw = CASES[case]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, heads, kv_heads)
    out, lse = reference_flash_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True, **kw)
    want, want_lse = _naive(q, k, v, lens_q, lens_k, True, kw.get("window_size_left", -1), scale=kw.get("scale"))
    assert out.dtype == BF16 and lse.dtype == torch.float32 and lse.shape == (heads, sum(lens_q))
    assert (out.double() - want).abs().max() <= 2e-2
    assert torch.equal(lse.isinf(), want_lse.isinf()) and (lse.double() - want_lse).nan_to_num(0).abs().max() <= 1e-3


def test_rows_outside_every_sequence_are_not_written():
    q, k, v, cu_q, cu_k = _packed([3, 2], [3, 2], extra_q=3)
    out = torch.full_like(q, 7.0)
    reference_flash_varlen(q, k, v, cu_q, cu_k, 3, 3, is_causal=True, out=out)
    assert (out[5:] == 7.0).all() and (out[:5] != 7.0).any()
    fresh, lse = reference_flash_varlen(q, k, v, cu_q, cu_k, 3, 3, is_causal=True)
    assert fresh[5:].isnan().all() and lse[:, 5:].isnan().all()  # uninitialized memory, not zeros
    assert torch.equal(fresh[:5], out[:5])


def test_non_causal_and_one_query_per_sequence():
    q, k, v, cu_q, cu_k = _packed([2, 3], [4, 3])
    out, _ = reference_flash_varlen(q, k, v, cu_q, cu_k, 3, 4, is_causal=False)
    assert (out.double() - _naive(q, k, v, [2, 3], [4, 3], False)[0]).abs().max() <= 2e-2
    # Every sequence one query: the kernel's swapped GQA path (cu_seqlens_q ignored) gives the same numbers.
    q, k, v, cu_q, cu_k = _packed([1, 1, 1], [5, 1, 3])
    out, _ = reference_flash_varlen(q, k, v, cu_q, cu_k, 1, 5, is_causal=True)
    assert (out.double() - _naive(q, k, v, [1, 1, 1], [5, 1, 3], True)[0]).abs().max() <= 2e-2


def test_the_serving_soaks_batch_fails_the_one_query_gqa_reshape():
    """The H200 soak's crash: one real token and the padded rows' empty sequence (cu [0, 1, 1]), 4 heads over 2
    K/V heads, head_dim 16, max_seqlen_q 1: FlashAttention-2 views q as (2 sequences, 2, 2, 16) and fails."""
    q, k, v, cu_q, cu_k = _packed([1, 0], [1, 0])
    with pytest.raises(RuntimeError, match=r"shape '\[2, 2, 2, 16\]' is invalid for input of size 64"):
        reference_flash_varlen(q, k, v, cu_q, cu_k, 1, 1, is_causal=True)
    out, _ = reference_flash_varlen(q, k, v, cu_q, cu_k, 2, 1, is_causal=True)  # max_seqlen_q is an upper bound
    assert (out.double() - v.double().repeat_interleave(2, 1)).abs().max() <= 1e-2  # one key: its value
    for kv_heads, window in ((4, {}), (2, dict(window_size_left=3))):  # no GQA, or a window: the general path
        q, k, v, cu_q, cu_k = _packed([1, 0], [1, 0], kv_heads=kv_heads)
        reference_flash_varlen(q, k, v, cu_q, cu_k, 1, 1, is_causal=True, **window)


def _bad(q, k, v, cu_q, cu_k):
    return {
        "fp32": ((q.float(), k.float(), v.float(), cu_q, cu_k, 3, 3, {}), "only support fp16 and bf16"),
        "mixed dtypes": ((q, k.half(), v, cu_q, cu_k, 3, 3, {}), "query and key must have the same dtype"),
        "int64 cu_seqlens": ((q, k, v, cu_q.long(), cu_k, 3, 3, {}), "cu_seqlens_q must have dtype int32"),
        "strided head_dim": ((q[..., ::2], k[..., ::2], v[..., ::2], cu_q, cu_k, 3, 3, {}),
                             "contiguous last dimension"),
        "head_dim 12": ((q[..., :12], k[..., :12], v[..., :12], cu_q, cu_k, 3, 3, {}), "multiple of 8"),
        "heads not a multiple": ((q[:, :3], k, v, cu_q, cu_k, 3, 3, {}), "must divide number of heads"),
        "v head_dim": ((q, k, v[..., :8], cu_q, cu_k, 3, 3, {}), "key and value must have shape"),
        "cu_seqlens_k length": ((q, k, v, cu_q, cu_k[:2], 3, 3, {}), "cu_seqlens_k must have shape"),
        "no sequence": ((q, k, v, cu_q[:1], cu_k[:1], 3, 3, {}), "batch size must be positive"),
        "max_seqlen_q too small": ((q, k, v, cu_q, cu_k, 2, 3, {}), "longer than max_seqlen_q=2"),
        "max_seqlen_k too small": ((q, k, v, cu_q, cu_k, 3, 2, {}), "longer than max_seqlen_k=2"),
        "cu past the rows": ((q[:4], k, v, cu_q, cu_k, 3, 3, {}), "ends past the 4 rows of q"),
        "out dtype": ((q, k, v, cu_q, cu_k, 3, 3, dict(out=torch.empty(q.shape))), "Output must have the same dtype"),
        "out shape": ((q, k, v, cu_q, cu_k, 3, 3, dict(out=q[:4].clone())), "out must have shape"),
    }


BAD = list(_bad(*_packed([3, 2], [3, 2])))


@pytest.mark.parametrize("case", BAD)
def test_reference_refuses_what_the_kernel_refuses(case):
    (q, k, v, cu_q, cu_k, max_q, max_k, kw), message = _bad(*_packed([3, 2], [3, 2]))[case]
    with pytest.raises(RuntimeError, match=message):
        reference_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, **kw)


def test_reference_is_capturable_and_checks_its_bounds_at_replay():
    """No host read: a graph captures it, replays follow the sequence table's contents, and a replay whose table
    breaks the captured bound fails as the device-side assert does."""
    q, k, v, cu_q, cu_k = _packed([3, 3], [3, 3])
    out = torch.empty_like(q)
    graph = EmulatedGraph()
    graph.capture_begin()
    reference_flash_varlen(q, k, v, cu_q, cu_k, 4, 4, is_causal=True, out=out)
    graph.capture_end()
    cu_q.copy_(torch.tensor([0, 2, 6], dtype=torch.int32))
    cu_k.copy_(cu_q)
    graph.replay()
    assert (out.double() - _naive(q, k, v, [2, 4], [2, 4], True)[0]).abs().max() <= 2e-2
    cu_q.copy_(torch.tensor([0, 1, 6], dtype=torch.int32))  # a 5-row sequence under a captured bound of 4
    cu_k.copy_(cu_q)
    with pytest.raises(RuntimeError, match="longer than max_seqlen_q=4"):
        graph.replay()
