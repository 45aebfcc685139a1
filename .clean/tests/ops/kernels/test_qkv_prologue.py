"""The q/k/v projection with the layer's input add + RMSNorm in front (``qkv_proj_rope(..., residual=,
norm_weight=)``) on the CPU: the steps it stands for, bit for bit; its return convention and argument checks; when the
kernel runs; the kernel under Triton's interpreter (``interpret_qkv_prologue.py``, in a fresh process; on CUDA in
``test_qkv_rope_cuda.py``) and compiled for sm_90."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import qkv_cases as cases
import torch
from interpreter import run_under_interpreter

from bcg.ops import kernels
from bcg.ops.kernels import qkv_rope

HERE = Path(__file__).resolve().parent
EPS = 1e-5


def inputs(dtype: torch.dtype = torch.float32, rows: int = 6) -> dict:
    x, w, positions, freqs = cases.model_inputs(rows, 64, 4, 2, 32, "cpu", dtype)
    residual = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    norm_weight = (torch.rand(64, generator=torch.Generator().manual_seed(8)) + 0.5).to(dtype)
    return dict(x=x, w=w, positions=positions, freqs=freqs, residual=residual, norm_weight=norm_weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["fused", "torch"])
@pytest.mark.parametrize("qk_norm,bias,cache", [(False, False, False), (True, False, False), (False, True, False),
                                                 (True, True, True)])
def test_with_a_residual_it_is_fused_add_rms_norm_then_qkv_proj_rope(dtype, impl, qk_norm, bias, cache):
    t = inputs(dtype)
    x, w, residual, norm_weight = t["x"], t["w"], t["residual"], t["norm_weight"]
    b = torch.randn(w.shape[0]).to(dtype) if bias else None
    norms = {"q_weight": (torch.rand(32) + 0.5).to(dtype), "k_weight": (torch.rand(32) + 0.5).to(dtype)}
    norms = norms if qk_norm else {}
    slots = torch.tensor([8, 0, 3, 5, 1, 10])
    caches = [[torch.zeros(11, 2, 32, dtype=dtype) for _ in range(2)] for _ in range(2)]
    x0, residual0 = x.clone(), residual.clone()
    got = kernels.qkv_proj_rope(x, w, b, t["positions"], t["freqs"], 4, 2, eps=EPS, impl=impl, residual=residual,
                                norm_weight=norm_weight, norm_eps=1e-6,
                                cache=(*caches[0], slots) if cache else None, **norms)
    assert torch.equal(x, x0) and torch.equal(residual, residual0), "x or residual changed"
    normed, summed = kernels.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, 1e-6, impl=impl)
    expected = kernels.qkv_proj_rope(normed, w, b, t["positions"], t["freqs"], 4, 2, eps=EPS, impl=impl,
                                     cache=(*caches[1], slots) if cache else None, **norms)
    assert len(got) == 4 and all(torch.equal(g, e) for g, e in zip(got, (*expected, summed)))
    assert torch.equal(got[3], residual + x)  # the new residual stream, rounded as `h = h + x` rounds it
    if cache:
        assert all(torch.equal(c, e) for c, e in zip(caches[0], caches[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_residual_it_is_rms_norm_then_qkv_proj_rope_and_returns_three(dtype):
    t = inputs(dtype)
    x0 = t["x"].clone()
    got = kernels.qkv_proj_rope(t["x"], t["w"], None, t["positions"], t["freqs"], 4, 2, norm_weight=t["norm_weight"])
    expected = kernels.qkv_proj_rope(kernels.rms_norm(t["x"], t["norm_weight"], 1e-6), t["w"], None, t["positions"],
                                     t["freqs"], 4, 2)
    assert torch.equal(t["x"], x0) and len(got) == 3 and all(torch.equal(g, e) for g, e in zip(got, expected))


def test_more_rows_than_the_kernel_takes_are_the_steps_too():
    t = inputs(torch.bfloat16, rows=qkv_rope.MAX_FUSED_ROWS + 1)
    got = kernels.qkv_proj_rope(t["x"], t["w"], None, t["positions"], t["freqs"], 4, 2, residual=t["residual"],
                                norm_weight=t["norm_weight"])
    normed, summed = kernels.fused_add_rms_norm(t["x"].clone(), t["residual"].clone(), t["norm_weight"], 1e-6)
    expected = kernels.qkv_proj_rope(normed, t["w"], None, t["positions"], t["freqs"], 4, 2)
    assert all(torch.equal(g, e) for g, e in zip(got, (*expected, summed)))


def test_a_given_residual_out_is_written_and_returned():
    t = inputs()
    residual_out = torch.full_like(t["residual"], float("nan"))
    *_, new = kernels.qkv_proj_rope(t["x"], t["w"], None, t["positions"], t["freqs"], 4, 2, residual=t["residual"],
                                    norm_weight=t["norm_weight"], residual_out=residual_out)
    assert new is residual_out and torch.equal(new, t["residual"] + t["x"])


def bad_call(**changes) -> str:
    t = inputs()
    args = dict(residual=t["residual"], norm_weight=t["norm_weight"]) | changes
    with pytest.raises(ValueError) as err:
        kernels.qkv_proj_rope(t["x"], t["w"], None, t["positions"], t["freqs"], 4, 2, **args)
    return str(err.value)


def test_bad_prologue_arguments_name_the_fix():
    t = inputs()
    assert "pass norm_weight" in bad_call(norm_weight=None)
    assert "norm_weight (32,) must be (64,)" in bad_call(norm_weight=torch.ones(32))
    assert "residual (5, 64) must have x's shape (6, 64)" in bad_call(residual=t["residual"][:5])
    assert "pass the residual stream" in bad_call(residual=None, residual_out=torch.empty(6, 64))
    assert "residual_out (6, 32) torch.float32 must have residual's shape" in bad_call(
        residual_out=torch.empty(6, 32))
    assert "must have residual's shape and dtype" in bad_call(residual_out=torch.empty(6, 64, dtype=torch.float16))
    x = t["x"]
    with pytest.raises(ValueError, match="overlaps x or residual.*a buffer of its own"):
        kernels.qkv_proj_rope(x, t["w"], None, t["positions"], t["freqs"], 4, 2, residual=t["residual"],
                              norm_weight=t["norm_weight"], residual_out=x)
    residual = t["residual"]
    for alias in (residual, residual[:], residual.view(6, 64)):  # the tensor or a view of it
        assert "overlaps x or residual" in bad_call(residual=residual, residual_out=alias)
    wide = torch.zeros(6, 128)
    assert "overlaps" in bad_call(residual=wide[:, :64], residual_out=wide[:, 32:96])  # a shifted window
    # Interleaved columns share no element but their address ranges meet: refused too (the check reads no data).
    assert "overlaps" in bad_call(residual=wide[:, :64], residual_out=wide[:, 64:])
    tall = torch.zeros(12, 64)
    assert kernels.qkv_proj_rope(x, t["w"], None, t["positions"], t["freqs"], 4, 2, residual=tall[:6],
                                 norm_weight=t["norm_weight"], residual_out=tall[6:])[3] is not None  # disjoint


def test_the_kernel_runs_with_the_prologue_only_for_operands_it_reads():
    x, w = torch.zeros(16, 32, dtype=torch.bfloat16), torch.zeros(8 * 64, 32, dtype=torch.bfloat16)

    def fused(**prologue) -> bool:
        return qkv_rope.is_fused(x, w, None, 64, False, **prologue)

    assert fused(norm_weight=torch.ones(32), residual=torch.zeros_like(x), residual_out=torch.zeros_like(x))
    assert fused(norm_weight=torch.ones(32, dtype=torch.bfloat16))  # read in fp32, whatever its dtype
    assert not fused(norm_weight=torch.ones(64)[::2])  # a strided norm weight
    assert not fused(norm_weight=torch.ones(32), residual=torch.zeros(16, 32))  # an fp32 residual stream
    assert not fused(norm_weight=torch.ones(32), residual=torch.zeros(32, 16, dtype=torch.bfloat16).t())  # columns


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: torch's CPU wheels do not bring it; pip install -e .[test] does")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernel")
@pytest.mark.interpreter(HERE / "interpret_qkv_prologue.py")  # started when the session is collected
def test_the_kernel_under_the_interpreter_in_a_fresh_process():
    run_under_interpreter(HERE / "interpret_qkv_prologue.py", allow_skips=False)


@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim,norm,add", [(16, 1024, 16, 4, 64, False, True),
                                                                     (1, 2048, 32, 8, 64, False, True),
                                                                     (16, 1024, 16, 8, 128, True, True),
                                                                     (16, 2048, 16, 4, 128, False, False)])
def test_the_prologue_kernel_compiles_for_sm90_without_spills(rows, hidden, heads, kv_heads, dim, norm, add):
    """The launcher's tiles at 1-16 rows of the llama and Qwen3 shapes on an H200 (Triton and its ptxas, no GPU):
    no spills, the loads pipelined, the split sum behind an acquire-release atomic."""
    pytest.importorskip("triton")
    from test_kernel_aot import assert_no_spills, compile_sm90

    from bcg.ops.kernels import triton_qkv_rope

    plan = triton_qkv_rope.tiling(rows, hidden, heads + 2 * kv_heads, dim, norm, 132)
    names = triton_qkv_rope._qkv_rope_kernel.arg_names
    constants = dict(HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HALF_N=plan.half_n, HAS_BIAS=False, HAS_NORM=norm,
                     HAS_CACHE=True, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, SPLIT_K=plan.split_k,
                     K_ITERS=plan.k_iters, NORM=True, ADD=add)
    scalars = {"eps": "fp32", "norm_eps": "fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "inv_freq_ptr": "*fp32",
               "bias_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32"}
    types = {n: scalars.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names if n not in constants}
    ptx: list[str] = []
    report = compile_sm90(triton_qkv_rope._qkv_rope_kernel, types, constants, num_warps=plan.num_warps,
                          num_stages=plan.num_stages, ptx=ptx,
                          aligned=("x_ptr", "x_stride", "w_ptr", "w_stride", "part_ptr", "count_ptr", "hidden",
                                   "res_ptr", "res_stride", "res_out_ptr", "res_out_stride", "nw_ptr"))
    assert_no_spills(report)
    assert "cp.async" in ptx[0], "the loads are not pipelined"
    assert ("atom" in ptx[0] and ".acq_rel" in ptx[0]) == (plan.split_k > 1)
    assert "rsqrt" in ptx[0], "the input norm's rstd"
