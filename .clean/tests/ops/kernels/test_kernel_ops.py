"""The fused kernels as ``torch.ops.bcg`` custom ops on the CPU: every op passes ``opcheck`` (schema, mutation
annotations, fake kernel, AOT tracing with dynamic shapes), computes what its entry point's reference computes, and is
what torch.compile traces for the fused path on any device, through Inductor included."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_cases import gen, inv_freq, randn
from op_samples import samples
from torch.library import opcheck

from bcg.ops import kernels
from bcg.ops.kernels import dispatch
from bcg.ops.kernels.library import KERNEL_OPS, kernel_op

CASES = [(name, i) for name, args in samples().items() for i in range(len(args))]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("g++") is None,
                              reason="Inductor's CPU code needs a C++ compiler (cc or g++)")


def test_every_kernel_op_has_samples_and_the_ops_are_all_bcg_kernels():
    assert set(samples()) == set(KERNEL_OPS)
    with pytest.raises(ValueError, match="registered twice"):
        spec = KERNEL_OPS["rms_norm"]
        kernel_op("rms_norm", mutates_args=(), reference=spec.reference, triton=spec.triton, fake=spec.fake)


@pytest.mark.parametrize(("name", "case"), CASES)
def test_kernel_op_passes_opcheck(name, case):
    """Schema and mutation annotations hold, the fake kernel's shapes, dtypes and strides are the real ones', and the
    op traces under AOT autograd with dynamic shapes (the CPU kernel is the reference)."""
    opcheck(KERNEL_OPS[name].op, samples()[name][case])


def _entry_point(name, args):
    """The entry point's reference (impl="torch") for an op's arguments, as the op's results."""
    if name == "rms_norm":
        return kernels.rms_norm(*args, impl="torch")
    if name in ("add_rms_norm", "fused_add_rms_norm_"):
        x, residual, weight, eps = (a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return kernels.fused_add_rms_norm(x, residual, weight, eps, impl="torch")
    if name == "silu_and_mul":
        return kernels.silu_and_mul(*args, impl="torch")
    if name == "qkv_norm_rope":
        qkv, positions, freqs, q_w, k_w, eps, heads, kv_heads = args
        return kernels.qkv_norm_rope(qkv, positions, freqs, heads, kv_heads, q_weight=q_w, k_weight=k_w, eps=eps,
                                     impl="torch")
    if name == "clamped_swiglu":
        return kernels.clamped_swiglu(*args, impl="torch")
    if name == "router_topk":
        logits, top_k, renormalize, out_dtype, rule, bias, n_group, topk_group, scaling, shared = args
        return kernels.router_topk(logits, top_k, renormalize=renormalize, out_dtype=out_dtype, rule=rule,
                                   correction_bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling,
                                   num_shared=shared, impl="torch")
    if name == "expert_order":
        return tuple(kernels.expert_order(*args, impl="torch"))
    y, slot, weights, *bias = args
    return kernels.moe_combine(y, slot, weights, **dict(zip(("bias", "row_expert"), bias)), impl="torch")


@pytest.mark.parametrize(("name", "case"), CASES)
def test_kernel_op_computes_what_its_entry_point_computes(name, case):
    args = samples()[name][case]
    want = _entry_point(name, args)
    got = KERNEL_OPS[name].op(*args)
    if name == "fused_add_rms_norm_":
        assert got is None
        got = args[:2]  # written in place
    for g, e in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want))):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_kernel_path_runs_the_op_only_while_tracing_the_fused_path():
    x = torch.zeros(2, 8)
    assert dispatch.kernel_path("fused", x) == dispatch.kernel_path("torch", x) == "torch"
    seen = []

    def fn(x):
        seen.append((dispatch.kernel_path("fused", x), dispatch.kernel_path("torch", x)))
        return x + 1

    torch._dynamo.reset()
    torch.compile(fn, backend="eager", fullgraph=True)(x)
    assert seen == [("op", "torch")]
    with pytest.raises(ValueError, match="fused, torch"):
        dispatch.kernel_path("triton", x)


def _layer(h, attn_out, w, gate_up, qkv, positions, freqs, logits, y_sorted, impl="fused"):
    """Every entry point as the models call them: the residual add in place and redirected (a layer's input must
    not be written), transformers' (1, T, H) rows, the q/k/v kernel into given outputs."""
    n, h = kernels.fused_add_rms_norm(attn_out, h, w, 1e-6, impl=impl)
    first, h0 = kernels.fused_add_rms_norm(attn_out[None].contiguous(), h[None], w, 1e-6,
                                           residual_out=torch.empty_like(h[None]), impl=impl)
    out = tuple(qkv.new_empty(qkv.shape[0], heads, 16) for heads in (4, 2, 2))
    q, k, v = kernels.qkv_norm_rope(qkv, positions, freqs, 4, 2, q_weight=w[:16], k_weight=w[16:32], out=out,
                                    impl=impl)
    weights, ids = kernels.router_topk(logits, 2, impl=impl)
    order = kernels.expert_order(ids, 8, impl=impl)
    glu = kernels.clamped_swiglu(gate_up, gate_up.new_ones(8, gate_up.shape[1]), ids[:, 0], 1.702, 7.0, impl=impl)
    return (n, h, first, h0, kernels.silu_and_mul(gate_up, impl=impl), glu, q, k, v,
            kernels.moe_combine(y_sorted, order.slot, weights, impl=impl), kernels.rms_norm(h, w, 1e-6, impl=impl))


def _layer_inputs(tokens: int = 5):
    f32 = torch.float32
    return (randn(tokens, 64, dtype=f32, device="cpu", seed=1), randn(tokens, 64, dtype=f32, device="cpu", seed=2),
            torch.rand(64, generator=gen(3)) + 0.5, randn(tokens, 20, dtype=f32, device="cpu", seed=4),
            randn(tokens, 128, dtype=f32, device="cpu", seed=5), torch.arange(tokens), inv_freq(16),
            randn(tokens, 8, dtype=f32, device="cpu", seed=6), randn(2 * tokens, 6, dtype=f32, device="cpu", seed=7))


def _ops_in_graph(impl):
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("bcg."))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda *a: _layer(*a, impl=impl), backend=backend, fullgraph=True)(*_layer_inputs())
    return ops


def test_the_fused_path_traces_the_ops_on_the_cpu_and_the_torch_path_none():
    assert sorted(set(_ops_in_graph("fused"))) == sorted(f"bcg.{name}" for name in KERNEL_OPS)
    assert _ops_in_graph("torch") == []


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=needs_cc)])
def test_compiled_kernels_match_eager_with_a_dynamic_token_count(backend):
    """Inductor (a C++ compiler on the CPU) takes the ops' graphs whole, including the redirected add on (1, T, H)
    rows that failed in Inductor's post-grad passes while that op wrote its inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(_layer, backend=backend, fullgraph=True, dynamic=True)
    for tokens in (5, 9):
        got, want = compiled(*_layer_inputs(tokens)), _layer(*_layer_inputs(tokens))
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
