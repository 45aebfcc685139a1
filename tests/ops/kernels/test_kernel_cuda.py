"""The fused kernels on CUDA against their references: odd sizes, zero and one row, strided views, NaN-poisoned
outputs, untouched inputs, CUDA-graph capture and replay, torch.compile, and the models' own layers.

Run with ``python -m pytest -m cuda tests/ops/kernels``.
"""

from __future__ import annotations

from dataclasses import replace

import kernel_cases as cases
import pytest
import torch
import torch.nn.functional as F
from op_samples import samples
from torch.library import opcheck

from bcg.models import get_preset
from bcg.models.dense import QKVProjection
from bcg.models.layers import RotaryEmbedding
from bcg.models.moe import MoEFFN
from bcg.ops import kernels
from bcg.ops.kernels.library import KERNEL_OPS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"
# Bit-exact fractions against the reference: the kernels keep every rounding of the eager code, so results differ
# only where fp32 intermediates do (reduction order, rsqrt); a lost or extra rounding would leave 50-75% exact.
MIN_EXACT = {torch.bfloat16: 0.98, torch.float16: 0.98, torch.float32: None}


class Fused:
    """Calls the public entry points with ``impl="fused"``."""

    ulps: dict = {}

    def rms_norm(self, x, w, eps, out):
        assert kernels.rms_norm(x, w, eps, out=out, impl="fused") is out

    def add_rms_norm(self, x, residual, w, eps, out, residual_out):
        in_place = out is x and residual_out is residual
        n, h = kernels.fused_add_rms_norm(x, residual, w, eps, out=None if in_place else out,
                                          residual_out=None if in_place else residual_out, impl="fused")
        assert n is out and h is residual_out

    def silu_and_mul(self, x, out):
        assert kernels.silu_and_mul(x, out=out, impl="fused") is out

    def clamped_swiglu(self, x, bias, expert, alpha, limit, out):
        out.copy_(kernels.clamped_swiglu(x, bias, expert, alpha, limit, impl="fused"))

    def qkv_norm_rope(self, qkv, positions, freqs, q_w, k_w, eps, q_out, k_out, v_out, cache=None):
        kernels.qkv_norm_rope(qkv, positions, freqs, q_out.shape[1], k_out.shape[1], q_weight=q_w, k_weight=k_w,
                              eps=eps, out=(q_out, k_out, v_out), impl="fused", cache=cache)

    def router_topk(self, logits, top_k, renormalize, out_dtype, **rule):
        return kernels.router_topk(logits, top_k, renormalize=renormalize, out_dtype=out_dtype, impl="fused", **rule)

    def expert_order(self, ids, experts):
        return kernels.expert_order(ids, experts, impl="fused")

    def moe_combine(self, y, slot, weights, out, **bias):
        assert kernels.moe_combine(y, slot, weights, out=out, impl="fused", **bias) is out

    def index_topk(self, *args):
        from bcg.ops.kernels.dsa_topk import index_topk

        return index_topk(*args, impl="fused")


RUN = Fused()
ROWS = [0, 1, 7, 300, 2048]


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 1000, 1024, 1536, 2048, 5120])
def test_rms_norm(dtype, rows, hidden):
    cases.check_rms_norm(RUN, DEV, dtype, rows, hidden, MIN_EXACT[dtype])


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 1000, 1024, 2048])
def test_fused_add_rms_norm(dtype, rows, hidden, in_place):
    cases.check_add_rms_norm(RUN, DEV, dtype, rows, hidden, MIN_EXACT[dtype], in_place=in_place)


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 1024, 2048])
def test_fused_add_rms_norm_partials(dtype, rows, hidden, parts):
    cases.check_add_rms_norm_partials(RUN, DEV, dtype, rows, hidden, parts, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [8, 500, 512, 2816, 5632])
def test_silu_and_mul(dtype, rows, inter):
    cases.check_silu_and_mul(RUN, DEV, dtype, rows, inter, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 16, 4, 64), (7, 16, 2, 128), (2048, 16, 4, 64)])
def test_qkv_norm_rope_writes_the_kv_cache(dtype, rows, heads, kv_heads, dim):
    cases.check_qkv_norm_rope_cache(RUN, DEV, dtype, rows, heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 2048])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 4, 64), (16, 4, 128), (16, 2, 64), (12, 4, 128), (3, 1, 80)])
def test_qkv_norm_rope(dtype, qk_norm, rows, heads, kv_heads, dim):
    cases.check_qkv_norm_rope(RUN, DEV, dtype, rows, heads, kv_heads, dim, qk_norm, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("experts,top_k,renormalize", [(32, 4, True), (64, 8, True), (8, 2, False), (6, 3, True)])
def test_router_topk(dtype, rows, experts, top_k, renormalize):
    cases.check_router_topk(RUN, DEV, dtype, rows, experts, top_k, renormalize, MIN_EXACT[dtype])


ROUTER_RULES = {  # (rule, renormalize, correction bias, n_group, topk_group, scaling, shared experts)
    "topk_softmax": ("topk_softmax", False, False, 1, 1, 1.0, 0),
    "sigmoid": ("sigmoid_topk", True, True, 1, 1, 1.0, 0),
    "sigmoid-groups": ("sigmoid_topk", True, True, 8, 4, 2.5, 0),
    "sigmoid-no-renorm-shared": ("sigmoid_topk", False, False, 4, 2, 1.5, 1),
}


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("experts,top_k", [(32, 4), (128, 8), (256, 8)])
@pytest.mark.parametrize("case", list(ROUTER_RULES))
def test_router_rules(dtype, rows, experts, top_k, case):
    rule, renormalize, bias, n_group, topk_group, scaling, shared = ROUTER_RULES[case]
    cases.check_router_topk(RUN, DEV, dtype, rows, experts, top_k, renormalize, MIN_EXACT[dtype], rule=rule, bias=bias,
                            n_group=n_group, topk_group=topk_group, scaling=scaling, num_shared=shared)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter,experts", [(2880, 32), (500, 3)])
def test_clamped_swiglu(dtype, rows, inter, experts, bias):
    cases.check_clamped_swiglu(RUN, DEV, dtype, rows, inter, experts, bias, MIN_EXACT[dtype])


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows", ROWS + [4096])
@pytest.mark.parametrize("experts,top_k", [(32, 4), (64, 8), (8, 2), (6, 3), (128, 8)])
def test_expert_order(rows, experts, top_k, ids_dtype):
    cases.check_expert_order(RUN, DEV, rows, experts, top_k, ids_dtype)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden,top_k", [(1024, 4), (1000, 2), (1536, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_moe_combine(dtype, rows, hidden, top_k, bias):
    cases.check_moe_combine(RUN, DEV, dtype, rows, hidden, top_k, MIN_EXACT[dtype], bias=bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_lens,prefix,topk,ties", [
    ([5, 7], [0, 0], 8, False), ([5, 7, 1], [0, 6, 3], 8, True), ([64], [0], 256, False),
    ([300, 5, 700], [1000, 0, 2000], 256, False), ([2048], [4000], 2048, False),
])
def test_index_topk(dtype, q_lens, prefix, topk, ties):
    cases.check_index_topk(RUN, DEV, dtype, q_lens, prefix, heads=4, dim=64, topk=topk, ties=ties)


def test_index_topk_runs_the_kernel_up_to_its_longest_range(monkeypatch):
    from bcg.ops.kernels import dsa_topk, triton_dsa

    calls = []
    real = triton_dsa.index_topk
    monkeypatch.setattr(triton_dsa, "index_topk", lambda *a: calls.append(a[8]) or real(*a))
    for k_len in (40, dsa_topk.MAX_FUSED_KEYS, dsa_topk.MAX_FUSED_KEYS + 1):
        args = cases.index_topk_inputs(DEV, torch.bfloat16, [8], [k_len - 8], 4, 64, pad=0, seed=1)
        dsa_topk.index_topk(*args, 16, impl="fused")
    assert calls == [64, dsa_topk.MAX_FUSED_KEYS]  # the sort's block; the longer range took the reference


def test_entry_points_run_the_triton_kernels(monkeypatch):
    from bcg.ops.kernels import triton_norm

    calls = []
    real = triton_norm.rms_norm
    monkeypatch.setattr(triton_norm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(4, 64, device=DEV), torch.ones(64, device=DEV)
    kernels.rms_norm(x, w, 1e-6)  # the default is "fused"
    kernels.rms_norm(x, w, 1e-6, impl="torch")
    assert len(calls) == 1 and kernels.fused_available(DEV)


def _all_ops(h, attn_out, w, gate_up, qkv, positions, freqs, logits, qkv_out, impl):
    n0, h0 = kernels.fused_add_rms_norm(attn_out, h, w, 1e-5, out=torch.empty_like(h),
                                        residual_out=torch.empty_like(h), impl=impl)  # inputs only read
    n, h = kernels.fused_add_rms_norm(attn_out, h, w, 1e-5, impl=impl)
    q, k, v = kernels.qkv_norm_rope(qkv, positions, freqs, 16, 4, out=qkv_out, impl=impl)
    weights, ids = kernels.router_topk(logits, 4, out_dtype=torch.bfloat16, impl=impl)
    order = kernels.expert_order(ids, 32, impl=impl)
    act = kernels.silu_and_mul(gate_up, impl=impl)
    y = kernels.moe_combine(act[order.token_index][:, :64].contiguous(), order.slot, weights, impl=impl)
    return n0, h0, n, h, q, k, v, act, y, kernels.rms_norm(h, w, 1e-5, impl=impl), order.group_end


def _inputs(seed: int, rows: int = 64):
    r = lambda *s, i: cases.randn(*s, dtype=torch.bfloat16, device=DEV, seed=seed * 10 + i)  # noqa: E731
    return [r(rows, 1024, i=0), r(rows, 1024, i=1), r(1024, i=2) + 1, r(rows, 2 * 2816, i=3),
            r(rows, 24 * 64, i=4), torch.randint(0, 4096, (rows,), generator=cases.gen(seed)).to(DEV),
            cases.inv_freq(64, device=DEV), r(rows, 32, i=5).float()]  # fp32 logits: no ties between experts


def test_cuda_graph_capture_and_replay_follow_fresh_inputs():
    """All fused kernels in one captured graph: no host sync, no allocation; replay follows refilled inputs."""
    static = _inputs(0)
    qkv_out = tuple(torch.empty(64, n, 64, dtype=torch.bfloat16, device=DEV) for n in (16, 4, 4))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: Triton compiles at the first call
        _all_ops(*[t.clone() for t in static], qkv_out, "fused")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _all_ops(*static, qkv_out, "fused")
    for step in (1, 2):
        fresh = _inputs(step)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        expected = _all_ops(*_inputs(step), None, "torch")
        for got, exp in zip(outs, expected):
            if got.dtype.is_floating_point:
                torch.testing.assert_close(got, exp, rtol=2 * 2**-8, atol=2 * 2**-8)
            else:
                assert torch.equal(got, exp)


def test_torch_compile_inductor_traces_the_fused_ops():
    inputs = _inputs(3)
    expected = _all_ops(*[t.clone() for t in inputs], None, "fused")
    torch._dynamo.reset()
    compiled = torch.compile(_all_ops, fullgraph=True, dynamic=False)
    got = compiled(*[t.clone() for t in inputs], None, "fused")
    for g, e in zip(got, expected):
        assert torch.equal(g, e)  # the same kernels run, opaque to Inductor


def test_torch_compile_inductor_with_a_dynamic_token_count_on_transformers_rows():
    """The ops with the token dimension dynamic and transformers' (1, T, H) rows, redirected residual included: the
    layout Inductor's post-grad passes rejected while the redirected add wrote its inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(_hf_layer, fullgraph=True, dynamic=True)
    for rows in (24, 40):
        inputs = _inputs(4, rows)[:4]
        got, want = compiled(*[t.clone() for t in inputs]), _hf_layer(*[t.clone() for t in inputs])
        for g, e in zip(got, want):
            assert torch.equal(g, e)


def _hf_layer(h, attn_out, w, gate_up):
    normed, summed = kernels.fused_add_rms_norm(attn_out[None].contiguous(), h[None], w, 1e-5,
                                                residual_out=torch.empty_like(h[None]))
    return normed, summed, kernels.silu_and_mul(gate_up[None]), kernels.rms_norm(summed, w, 1e-5)


@pytest.mark.parametrize(("name", "case"), [(n, i) for n, args in samples().items() for i in range(len(args))])
def test_kernel_ops_pass_opcheck_on_cuda(name, case):
    """The CUDA kernels (Triton) against the schemas and fake kernels, on the CPU tier's samples."""
    opcheck(KERNEL_OPS[name].op, samples(DEV)[name][case])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_norm_rope_against_the_models_projection_in_bf16(qk_norm):
    config = replace(get_preset("llama-dense"), qk_norm=qk_norm, attention_bias=True)
    proj = QKVProjection(config).to(DEV, torch.bfloat16)
    for i, param in enumerate(proj.parameters()):
        param.data = cases.randn(*param.shape, dtype=torch.bfloat16, device=DEV, seed=i, scale=0.05)
    if qk_norm:
        proj.q_norm.weight.data += 1
        proj.k_norm.weight.data += 1
    rope = RotaryEmbedding(config.head_dim, config.rope_theta).to(DEV)
    rope.reset_parameters()
    x = cases.randn(512, config.hidden_size, dtype=torch.bfloat16, device=DEV, seed=9)
    positions = torch.arange(512, device=DEV) + 1000
    with torch.no_grad():
        expected = proj(x, rope.rope(positions))
        weights = {"q_weight": proj.q_norm.weight, "k_weight": proj.k_norm.weight} if qk_norm else {}
        got = kernels.qkv_norm_rope(proj.qkv_proj(x), positions, rope.inv_freq, config.num_heads, config.num_kv_heads,
                                    eps=config.rms_norm_eps, impl="fused", **weights)
    for g, e, name in zip(got, expected, "qkv"):
        cases.assert_matches(g, e, min_exact=0.98, rtol_ulps=2.0, what=name)


def test_moe_layer_with_fused_kernels_matches_the_layer_in_bf16():
    """The gptoss-moe FFN rebuilt on the fused kernels; rows whose bf16 router logits tie at the top-k boundary may
    pick another (equally weighted) expert and are left out of the comparison."""
    config = get_preset("gptoss-moe")
    ffn = MoEFFN(config)
    for i, param in enumerate(ffn.parameters()):
        param.data = cases.randn(*param.shape, dtype=torch.float32, device="cpu", seed=i, scale=0.03)
    ffn = ffn.to(DEV, torch.bfloat16)
    ffn.prepare()
    x = cases.randn(300, config.hidden_size, dtype=torch.bfloat16, device=DEV, seed=2)
    with torch.no_grad():
        expected = ffn(x)
        logits = ffn.gate(x)
        weights, ids = kernels.router_topk(logits, ffn.top_k, renormalize=ffn.norm_topk_prob, impl="fused")
        order = kernels.expert_order(ids, ffn.num_experts, impl="fused")
        x_sorted = x[order.token_index]
        if ffn.use_grouped_mm:
            gate_up = F.grouped_mm(x_sorted, ffn.experts_gate_up.transpose(-2, -1), offs=order.group_end)
            act = kernels.silu_and_mul(gate_up, impl="fused")
            y_sorted = F.grouped_mm(act, ffn.experts_down.transpose(-2, -1), offs=order.group_end)
        else:
            gate_up = torch.bmm(ffn.experts_gate_up[order.expert], x_sorted[:, :, None]).squeeze(-1)
            act = kernels.silu_and_mul(gate_up, impl="fused")
            y_sorted = torch.bmm(ffn.experts_down[order.expert], act[:, :, None]).squeeze(-1)
        got = kernels.moe_combine(y_sorted, order.slot, weights, impl="fused")
    _, ref_ids = ffn.route(x)
    same = (ids.sort(dim=-1).values == ref_ids.sort(dim=-1).values).all(dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).sort(dim=-1, descending=True).values
    boundary_tie = probs[:, ffn.top_k - 1] == probs[:, ffn.top_k]
    assert bool((same | boundary_tie).all()) and same.float().mean() > 0.8
    cases.assert_matches(got[same], expected[same], min_exact=0.9, rtol_ulps=2.0, what="moe layer")
