"""The MLP's one-kernel fusions on the CPU, swiglu_down and gate_up_silu: the two steps each replaces exactly, the
rules that pick the one kernel, the kernels' tiles, and the MLP that calls them (the kernels run under the
interpreter in interpret_kernels.py, on CUDA in test_mlp_kernels_cuda.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DTYPES, randn, row_view

from bcg import env
from bcg.models.layers import SwiGLUMLP
from bcg.ops import kernels
from bcg.ops.kernels import down_proj as module


@pytest.mark.parametrize("dtype", DTYPES)
def test_is_the_activation_then_the_projection(dtype):
    x, w = row_view(7, 2 * 300, dtype=dtype, device="cpu", seed=0), randn(50, 300, dtype=dtype, device="cpu", seed=1)
    expected = F.linear(kernels.silu_and_mul(x), w)
    assert torch.equal(kernels.swiglu_down(x, w), expected)
    assert torch.equal(kernels.swiglu_down(x, w, impl="torch"), expected)
    assert torch.equal(kernels.swiglu_down_reference(x, w), expected)
    assert kernels.swiglu_down(x[None], w).shape == (1, 7, 50)


def test_rejects_mismatched_operands_by_name():
    with pytest.raises(ValueError, match=r"gate_up \(\.\.\., 2I\)"):
        kernels.swiglu_down(torch.randn(3, 10), torch.randn(4, 6))
    with pytest.raises(ValueError, match="unknown kernels implementation"):
        kernels.swiglu_down(torch.randn(3, 10), torch.randn(4, 5), impl="triton")


def test_one_kernel_only_for_short_half_precision_batches():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    rows = module.MAX_FUSED_ROWS
    assert module.is_fused(torch.zeros(rows, 32, dtype=torch.bfloat16), w)
    assert module.is_fused(torch.zeros(2, 3, 32, dtype=torch.bfloat16), w)
    assert not module.is_fused(torch.zeros(rows + 1, 32, dtype=torch.bfloat16), w)  # cuBLAS needs no split there
    assert not module.is_fused(torch.zeros(0, 32, dtype=torch.bfloat16), w)  # an empty grid is not launched
    assert not module.is_fused(torch.zeros(4, 32), w.float())  # fp32: tl.dot would round to tf32
    assert not module.is_fused(torch.zeros(4, 32, dtype=torch.float16), w)  # mixed dtypes
    assert not module.is_fused(torch.zeros(4, 64, dtype=torch.bfloat16)[:, ::2], w)  # strided columns


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the tiling is computed with triton.cdiv")
@pytest.mark.parametrize("rows,cols,inner,sms", [(64, 1024, 2816, 132), (64, 2048, 8192, 132), (1, 64, 64, 132),
                                                 (128, 2048, 8192, 132), (7, 100, 300, 16), (64, 8192, 4096, 132)])
def test_tiles_cover_k_once_and_fill_the_sms(rows, cols, inner, sms):
    from bcg.ops.kernels.triton_down_proj import tiling

    plan = tiling(rows, cols, inner, sms)
    steps = -(-inner // plan.block_k)
    assert plan.split_k * plan.k_iters >= steps > (plan.split_k - 1) * plan.k_iters  # every step, no empty split
    assert plan.block_m >= min(rows, 128) or rows > 128
    assert plan.tiles == -(-rows // plan.block_m) * -(-cols // plan.block_n)
    assert plan.split_k == 1 or plan.k_iters >= 4
    programs = plan.tiles * plan.split_k
    assert programs >= min(sms, plan.tiles * (steps // 4)) or plan.split_k == 1 and plan.tiles >= 2 * sms


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("fusion", ["none", "gate_up", "down"])
@pytest.mark.parametrize("kernels_impl", ["fused", "torch"])
def test_mlp_matches_its_unfused_arithmetic(kernels_impl, fusion, norm, monkeypatch):
    """Every BCG_MLP_FUSION is the same arithmetic on the CPU (the kernels' references), with a norm handed in to
    fold (BCG_NORM_FUSION) or not."""
    monkeypatch.setattr(env, "MLP_FUSION", fusion)
    mlp = SwiGLUMLP(32, 80).to(torch.bfloat16)
    mlp.kernels = kernels_impl
    x = randn(5, 32, dtype=torch.bfloat16, device="cpu", seed=3)
    weight = 1 + randn(32, dtype=torch.bfloat16, device="cpu", seed=4, scale=0.2) if norm else None
    gate, up = mlp.gate_up_proj(x if weight is None else F.rms_norm(x, (32,), weight, 1e-5)).chunk(2, dim=-1)
    assert torch.equal(mlp(x, weight, 1e-5), mlp.down_proj(F.silu(gate) * up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_silu_is_the_projection_then_the_activation(dtype):
    x, w = row_view(7, 48, dtype=dtype, device="cpu", seed=0), randn(2 * 30, 48, dtype=dtype, device="cpu", seed=1)
    expected = kernels.silu_and_mul(F.linear(x, w))
    assert torch.equal(kernels.gate_up_silu(x, w), expected)
    assert torch.equal(kernels.gate_up_silu(x, w, impl="torch"), expected)
    assert kernels.gate_up_silu(x[None], w).shape == (1, 7, 30)
    with pytest.raises(ValueError, match=r"weight \(2I, H\)"):
        kernels.gate_up_silu(x, w[:-1])
    with pytest.raises(ValueError, match=r"weight \(2I, H\)"):
        kernels.gate_up_silu(x, w[:, :-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_silu_with_a_norm_is_the_norm_then_the_two_steps(dtype):
    """BCG_NORM_FUSION's entry point off the one kernel: bcg's rms_norm, the projection, SiLU-and-multiply, exactly."""
    x, w = row_view(7, 48, dtype=dtype, device="cpu", seed=0), randn(2 * 30, 48, dtype=dtype, device="cpu", seed=1)
    norm = 1 + randn(48, dtype=dtype, device="cpu", seed=2, scale=0.2)
    expected = kernels.silu_and_mul(F.linear(kernels.rms_norm(x, norm, 1e-5), w))
    assert torch.equal(kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5), expected)
    assert torch.equal(kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5, impl="torch"), expected)
    assert not torch.equal(kernels.gate_up_silu(x, w, norm_weight=norm, eps=1e-5), kernels.gate_up_silu(x, w))
    assert kernels.gate_up_silu(x[None], w, norm_weight=norm).shape == (1, 7, 30)
    with pytest.raises(ValueError, match=r"norm_weight must be \(H,\) = \(48,\)"):
        kernels.gate_up_silu(x, w, norm_weight=norm[:-1])
    with pytest.raises(ValueError, match=r"norm_weight must be \(H,\)"):
        kernels.gate_up_silu(x, w, norm_weight=norm[None])
    with pytest.raises(ValueError, match=r"weight \(2I, H\)"):
        kernels.gate_up_silu(x, w[:-1], norm_weight=norm)
    with pytest.raises(ValueError, match="unknown kernels implementation"):
        kernels.gate_up_silu(x, w, norm_weight=norm, impl="triton")


@pytest.mark.parametrize("norm", [None, torch.ones(8, dtype=torch.bfloat16)])
def test_gate_up_silu_one_kernel_only_for_short_half_precision_batches(norm):
    """The same rule with the norm folded in or not; a norm weight that is not one contiguous vector takes the steps."""
    from bcg.ops.kernels import gate_up

    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    assert gate_up.is_fused(torch.zeros(gate_up.MAX_FUSED_ROWS, 8, dtype=torch.bfloat16), w, norm)
    assert not gate_up.is_fused(torch.zeros(gate_up.MAX_FUSED_ROWS + 1, 8, dtype=torch.bfloat16), w, norm)
    assert not gate_up.is_fused(torch.zeros(0, 8, dtype=torch.bfloat16), w, norm)
    assert not gate_up.is_fused(torch.zeros(4, 8), w.float(), norm)
    assert not gate_up.is_fused(torch.zeros(4, 8, dtype=torch.bfloat16), w.t().contiguous().t(), norm)  # not row-major
    assert gate_up.is_fused(torch.zeros(4, 8, dtype=torch.bfloat16), w, torch.ones(8))  # an fp32 scale is read as is
    assert not gate_up.is_fused(torch.zeros(4, 8, dtype=torch.bfloat16), w, torch.ones(16)[::2])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the tiling is computed with triton.cdiv")
def test_gate_up_tiles_are_the_sweeps_pick():
    from bcg.ops.kernels.triton_gate_up import tiling

    assert tiling(64, 2816, 132).block_n == 32 and tiling(64, 2816, 132).block_k == 128  # the sweep's pick
    assert tiling(40, 2816, 132).block_m == 64  # wgmma, the extra rows masked
    assert tiling(200, 64, 132)[:3] == (128, 32, 64) and tiling(5, 64, 132).block_m == 16


@pytest.mark.parametrize(("value", "expected"), [("", "gate_up"), ("NONE", "none"), ("down", "down")])
def test_the_mlp_fusion_switch_is_read_once_and_checked(value, expected):
    """BCG_MLP_FUSION: unset is the gate/up epilogue; a value that names no fusion stops the import with the choices."""
    import subprocess
    import sys

    code = "from bcg import env; print(env.MLP_FUSION)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BCG_MLP_FUSION": value})
    assert run.returncode == 0 and run.stdout.strip() == expected, run.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BCG_MLP_FUSION": "epilogue"})
    assert bad.returncode != 0 and "expected gate_up, down or none" in bad.stderr
