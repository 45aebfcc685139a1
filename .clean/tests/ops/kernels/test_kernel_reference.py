"""Fused-kernel entry points on the reference path (CPU): they compute exactly what the models compute today,
dispatch as documented and reject bad input by name (their custom ops: test_kernel_ops.py)."""

from __future__ import annotations

from dataclasses import replace

import kernel_cases as cases
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DTYPES, gen, inv_freq, randn, row_view

from bcg.models import build_model, get_preset
from bcg.models.dense import QKVProjection
from bcg.models.layers import RMSNorm, RotaryEmbedding
from bcg.ops import kernels
from bcg.ops.kernels import dispatch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 64), (1, 1000), (7, 1536)])
def test_rms_norm_and_fused_add_match_the_model_layers(dtype, rows, hidden):
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = randn(hidden, dtype=dtype, device="cpu", seed=1)
    x = row_view(rows, hidden, dtype=dtype, device="cpu", seed=2)
    assert torch.equal(kernels.rms_norm(x, norm.weight, 1e-5), norm(x))
    h, attn_out = randn(rows, hidden, dtype=dtype, device="cpu", seed=3), randn(rows, hidden, dtype=dtype,
                                                                                 device="cpu", seed=4)
    expected_h = h + attn_out  # the decoder layer's residual add
    expected_n = norm(expected_h)
    x0, h0 = attn_out.clone(), h.clone()
    n_out, h_out = torch.empty_like(h), torch.empty_like(h)
    n2, h3 = kernels.fused_add_rms_norm(attn_out, h, norm.weight, 1e-5, out=n_out, residual_out=h_out)
    assert n2 is n_out and h3 is h_out and torch.equal(attn_out, x0) and torch.equal(h, h0)  # inputs only read
    n, h2 = kernels.fused_add_rms_norm(attn_out, h, norm.weight, 1e-5)
    assert n is attn_out and h2 is h
    assert torch.equal(h, expected_h) and torch.equal(n, expected_n)
    assert torch.equal(h_out, expected_h) and torch.equal(n_out, expected_n)


def test_rms_norm_writes_out_and_checks_shapes():
    x, w = torch.randn(3, 10), torch.rand(10)
    out = torch.empty(3, 10, dtype=torch.float64)
    assert kernels.rms_norm(x, w, 1e-6, out=out) is out
    assert torch.allclose(out, F.rms_norm(x, (10,), w, 1e-6).double())
    with pytest.raises(ValueError, match="same shape"):
        kernels.fused_add_rms_norm(x, torch.randn(3, 11), w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_swiglu(dtype):
    x = row_view(5, 2 * 2816, dtype=dtype, device="cpu", seed=0)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(kernels.silu_and_mul(x), F.silu(gate) * up)
    with pytest.raises(ValueError, match="even last dimension"):
        kernels.silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_norm_rope_matches_the_models_projection(dtype, qk_norm):
    """The reference reproduces QKVProjection bit for bit: same rotation, same roundings, v copied."""
    config = replace(get_preset("tiny-dense"), qk_norm=qk_norm, attention_bias=True, rope_theta=150000.0)
    proj = QKVProjection(config).to(dtype)
    for i, param in enumerate(proj.parameters()):
        param.data = randn(*param.shape, dtype=dtype, device="cpu", seed=10 + i, scale=0.5)
    rope = RotaryEmbedding(config.head_dim, config.rope_theta)
    x = randn(9, config.hidden_size, dtype=dtype, device="cpu", seed=1)
    positions = torch.tensor([0, 1, 2, 3, 700, 701, 4000, 5, 6])
    with torch.no_grad():
        expected = proj(x, rope.rope(positions))
        qkv = proj.qkv_proj(x)
        weights = {"q_weight": proj.q_norm.weight, "k_weight": proj.k_norm.weight} if qk_norm else {}
        got = kernels.qkv_norm_rope(qkv, positions, rope.inv_freq, config.num_heads, config.num_kv_heads,
                                    eps=config.rms_norm_eps, **weights)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_qkv_norm_rope_writes_given_strided_buffers_and_rejects_bad_shapes():
    heads, kv_heads, dim, rows = 4, 2, 16, 6
    qkv = row_view(rows, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cpu", seed=0)
    positions, freqs = torch.arange(rows), inv_freq(dim)
    # Bridge-like outputs: views into wider fp32 buffers, written in place and cast.
    bufs = [torch.zeros(rows + 2, n + 1, dim) for n in (heads, kv_heads, kv_heads)]
    out = tuple(b[:rows, :-1] for b in bufs)
    got = kernels.qkv_norm_rope(qkv, positions, freqs, heads, kv_heads, out=out)
    assert all(g is o for g, o in zip(got, out))
    plain = kernels.qkv_norm_rope(qkv, positions, freqs, heads, kv_heads)
    assert all(torch.equal(g.to(torch.bfloat16), p) for g, p in zip(got, plain))
    assert all(not b[rows:].any() and not b[:, -1].any() for b in bufs)  # nothing outside the views
    with pytest.raises(ValueError, match="positions"):
        kernels.qkv_norm_rope(qkv, positions[:-1], freqs, heads, kv_heads)
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        kernels.qkv_norm_rope(qkv, positions, freqs, heads, kv_heads, q_weight=torch.ones(dim))
    with pytest.raises(ValueError, match="inv_freq"):
        kernels.qkv_norm_rope(qkv, positions, freqs[:-1], heads, kv_heads)


def _moe(dtype: torch.dtype, norm_topk_prob: bool):
    config = replace(get_preset("tiny-moe"), norm_topk_prob=norm_topk_prob)
    ffn = build_model(config, "cpu", dtype, seed=5).layers[0].mlp
    ffn.use_grouped_mm = False  # the exact bmm path; grouped_mm's grouping is the same
    return ffn


def _moe_forward_with_kernels(ffn, x: torch.Tensor) -> torch.Tensor:
    """MoEFFN.forward (bmm path) rewritten on the kernel entry points, as the lead will wire it."""
    weights, ids = kernels.router_topk(ffn.gate(x), ffn.top_k, renormalize=ffn.norm_topk_prob, out_dtype=x.dtype)
    order = kernels.expert_order(ids, ffn.num_experts)
    x_sorted = x[order.token_index]
    gate_up = torch.bmm(ffn.experts_gate_up[order.expert], x_sorted[:, :, None]).squeeze(-1)
    y_sorted = torch.bmm(ffn.experts_down[order.expert], kernels.silu_and_mul(gate_up)[:, :, None]).squeeze(-1)
    return kernels.moe_combine(y_sorted, order.slot, weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_pieces_reproduce_the_moe_layer(dtype, norm_topk_prob):
    ffn = _moe(dtype, norm_topk_prob)
    x = randn(13, 64, dtype=dtype, device="cpu", seed=2)
    with torch.no_grad():
        weights, ids = kernels.router_topk(ffn.gate(x), ffn.top_k, renormalize=norm_topk_prob, out_dtype=dtype)
        expected_w, expected_ids = ffn.route(x)
        assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_w) and weights.dtype == dtype
        assert torch.equal(_moe_forward_with_kernels(ffn, x), ffn(x))


def test_expert_order_is_the_stable_sort_and_its_inverse():
    ids = torch.randint(0, 6, (40, 3), generator=gen(0))
    order = kernels.expert_order(ids, 8)  # experts 6 and 7 get no rows
    flat = ids.flatten()
    assert torch.equal(order.expert, flat.sort(stable=True).values)
    assert torch.equal(order.token_index, flat.sort(stable=True).indices // 3)
    assert torch.equal(order.expert[order.slot.flatten()], flat)  # slot inverts the sort
    assert order.group_end.dtype == torch.int32 and order.group_end.tolist() == torch.bincount(
        flat, minlength=8).cumsum(0).tolist()
    empty = kernels.expert_order(ids[:0], 8)
    assert empty.group_end.tolist() == [0] * 8 and empty.token_index.numel() == 0


def test_router_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        kernels.router_topk(torch.randn(2, 4), 5)


def test_dispatch_runs_the_reference_off_cuda_and_names_a_bad_impl():
    assert not kernels.fused_available("cpu")
    x = torch.randn(2, 8)
    assert not dispatch.use_fused("fused", x) and not dispatch.use_fused("torch", x)  # CPU runs the reference
    assert not hasattr(kernels, "set_kernels")  # no process default: the models pass their own setting
    with pytest.raises(ValueError, match="fused, torch"):
        dispatch.use_fused("triton", x)
    with pytest.raises(ValueError, match="unknown kernels"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, impl="cuda")


def test_fused_on_cuda_without_triton_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: False)
    fake_cuda = torch.empty(2, 8, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "meta"))
    with pytest.raises(RuntimeError, match="kernels='torch'"):
        dispatch.use_fused("fused", fake_cuda)
    assert not dispatch.use_fused("torch", fake_cuda)


def test_dispatch_traces_under_torch_compile():
    """use_fused runs inside compiled model code; its Triton probe must not break a fullgraph trace."""
    def fn(x):
        return x + 1 if dispatch.triton_importable() else x - 1

    torch._dynamo.reset()
    x = torch.zeros(3)
    assert torch.equal(torch.compile(fn, backend="eager", fullgraph=True)(x), fn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_norm_rope_writes_the_kv_cache_in_the_reference(dtype):
    """The reference path (CPU, and the compiled op) writes the caches as index_copy_ does."""

    class Reference:
        def qkv_norm_rope(self, qkv, positions, freqs, q_w, k_w, eps, q_out, k_out, v_out, cache=None):
            kernels.qkv_norm_rope(qkv, positions, freqs, q_out.shape[1], k_out.shape[1], q_weight=q_w, k_weight=k_w,
                                  eps=eps, out=(q_out, k_out, v_out), impl="torch", cache=cache)

    cases.check_qkv_norm_rope_cache(Reference(), "cpu", dtype, 9, 4, 2, 16)
    with pytest.raises(ValueError, match="slots"):
        kernels.qkv_norm_rope(torch.randn(3, 64), torch.arange(3), torch.ones(4), 4, 2, impl="torch",
                              cache=(torch.zeros(8, 2, 8), torch.zeros(8, 2, 8), torch.arange(2)))
