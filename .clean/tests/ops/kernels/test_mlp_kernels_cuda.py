"""The MLP's one-kernel fusions on CUDA: swiglu_down against fp64 at odd sizes and at the llama shapes, forced into
K splits of every size, its dispatch, capture and replay, and what happens when its counters would be made in a
capture; gate_up_silu the same way, also with the RMSNorm folded in (BCG_NORM_FUSION); the MLP under each
BCG_MLP_FUSION. Run with ``python -m pytest -m cuda tests/ops/kernels``."""

from __future__ import annotations

import mlp_cases as cases
import pytest
import torch
import torch.nn.functional as F

from bcg import env
from bcg.models.layers import SwiGLUMLP
from bcg.ops import kernels
from bcg.ops.kernels import down_proj as module
from bcg.ops.kernels import gate_up, tile_counters, triton_down_proj, triton_gate_up

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols,inner,num_sms", cases.SHAPES + cases.LLAMA_SHAPES)
def test_kernel_matches_fp64(dtype, rows, cols, inner, num_sms):
    cases.check_swiglu_down(cases.direct(triton_down_proj), DEV, dtype, rows, cols, inner, num_sms)


@pytest.mark.parametrize("rows", [1, 17, 64, module.MAX_FUSED_ROWS, module.MAX_FUSED_ROWS + 1, 512])
def test_entry_point_runs_one_kernel_up_to_its_rows(rows):
    x, w = cases.inputs(rows, 1024, 2816, torch.bfloat16, DEV)
    two_steps = F.linear(kernels.silu_and_mul(x), w)
    got = kernels.swiglu_down(x, w)
    if rows > module.MAX_FUSED_ROWS:
        assert torch.equal(got, two_steps)  # the unfused path, unchanged
        return
    # The fused kernel: the same products summed in another order; cuBLAS is not bit-exact to it.
    torch.testing.assert_close(got.float(), two_steps.float(), rtol=2**-7, atol=2**-7 * float(two_steps.abs().max()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.swiglu_down(x, w)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names == ["_swiglu_down_kernel"], names


def test_capture_and_replay_follow_fresh_inputs():
    x, w = cases.inputs(64, 1024, 2816, torch.bfloat16, DEV)
    static = x.clone()
    kernels.swiglu_down(static, w)  # warm-up: compiles the kernel and makes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.swiglu_down(static, w)
    for seed in (1, 2, 3):
        fresh = x * (1 + 0.25 * seed)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, kernels.swiglu_down(fresh, w)), "replay differs from the eager kernel"


def test_counters_are_not_made_in_a_capture(monkeypatch):
    monkeypatch.setattr(tile_counters, "_COUNTERS", {})
    x, w = cases.inputs(64, 1024, 2816, torch.bfloat16, DEV)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(graph):
            kernels.swiglu_down(x, w)
    monkeypatch.setattr(tile_counters, "_COUNTERS", {})
    assert torch.equal(kernels.swiglu_down(x, w), kernels.swiglu_down(x.clone(), w))  # the device is still usable


@pytest.mark.parametrize("fusion", ["none", "gate_up", "down"])
def test_mlp_in_bf16_matches_the_torch_path(fusion, monkeypatch):
    monkeypatch.setattr(env, "MLP_FUSION", fusion)
    mlp = SwiGLUMLP(1024, 2816).to(DEV, torch.bfloat16)
    x = torch.randn(64, 1024, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.kernels = "torch"
        expected = mlp(x)
        mlp.kernels = "fused"
        got = mlp(x)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2**-7 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,inter,num_sms", cases.GATE_UP_SHAPES + cases.GATE_UP_LLAMA_SHAPES)
def test_gate_up_kernel_matches_fp64(dtype, rows, hidden, inter, num_sms):
    cases.check_gate_up_silu(cases.direct_gate_up(triton_gate_up), DEV, dtype, rows, hidden, inter, num_sms)


@pytest.mark.parametrize("rows", [1, 33, gate_up.MAX_FUSED_ROWS, gate_up.MAX_FUSED_ROWS + 1])
def test_gate_up_entry_point_runs_one_kernel_up_to_its_rows(rows):
    x = cases.randn(rows, 1024, dtype=torch.bfloat16, device=DEV, seed=rows)
    w = cases.randn(2 * 2816, 1024, dtype=torch.bfloat16, device=DEV, seed=1, scale=1024**-0.5)
    two_steps = kernels.silu_and_mul(F.linear(x, w))
    got = kernels.gate_up_silu(x, w)
    if rows > gate_up.MAX_FUSED_ROWS:
        assert torch.equal(got, two_steps)
        return
    torch.testing.assert_close(got.float(), two_steps.float(), rtol=2**-7, atol=2**-7 * float(two_steps.abs().max()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.gate_up_silu(x, w)
    x.mul_(0.5)
    graph.replay()
    assert torch.equal(captured, kernels.gate_up_silu(x, w)), "replay differs from the eager kernel"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,inter,num_sms", cases.GATE_UP_NORM_SHAPES + cases.GATE_UP_NORM_LLAMA_SHAPES)
def test_gate_up_kernel_with_the_norm_folded_in_matches_fp64(dtype, rows, hidden, inter, num_sms):
    cases.check_gate_up_silu(cases.direct_gate_up(triton_gate_up), DEV, dtype, rows, hidden, inter, num_sms, norm=True)


@pytest.mark.parametrize("rows", [1, 16, gate_up.MAX_FUSED_ROWS, gate_up.MAX_FUSED_ROWS + 1])
def test_gate_up_entry_point_folds_the_norm_into_its_one_kernel(rows):
    """Up to its rows the norm is no kernel of its own (one launch in all, replayed as run eagerly); past them it is
    bcg's rms_norm kernel and the two steps, exactly."""
    x = cases.randn(rows, 2048, dtype=torch.bfloat16, device=DEV, seed=rows, scale=4.0)
    w = cases.randn(2 * 8192, 2048, dtype=torch.bfloat16, device=DEV, seed=1, scale=2048**-0.5)
    norm = 1 + cases.randn(2048, dtype=torch.bfloat16, device=DEV, seed=2, scale=0.2)
    steps = kernels.silu_and_mul(F.linear(kernels.rms_norm(x, norm, 1e-5), w))
    got = kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5)
    if rows > gate_up.MAX_FUSED_ROWS:
        assert torch.equal(got, steps)
        return
    # The fold rounds x * w_norm where the steps round the normed rows: bf16 rounding apart, not bit-exact.
    torch.testing.assert_close(got.float(), steps.float(), rtol=2**-6, atol=2**-6 * float(steps.abs().max()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names == ["_gate_up_silu_kernel"], names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5)
    x.copy_(cases.randn(rows, 2048, dtype=torch.bfloat16, device=DEV, seed=rows + 1))  # not scaled: the norm undoes it
    graph.replay()
    assert torch.equal(captured, kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5)), "replay differs from eager"
