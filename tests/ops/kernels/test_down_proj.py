"""swiglu_down on the CPU: the two steps it replaces exactly, the rule that picks the one kernel, the kernel's tiles,
and the MLP that calls it (its kernel runs under the interpreter in interpret_kernels.py, on CUDA in
test_down_proj_cuda.py)."""

from __future__ import annotations

import importlib.util

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


def test_one_kernel_only_when_asked_and_for_short_half_precision_batches(monkeypatch):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(env, "SWIGLU_DOWN", False)  # the default: the two steps measured faster
    assert not module.is_fused(torch.zeros(4, 32, dtype=torch.bfloat16), w)
    monkeypatch.setattr(env, "SWIGLU_DOWN", True)
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


@pytest.mark.parametrize("kernels_impl", ["fused", "torch"])
def test_mlp_matches_its_unfused_arithmetic(kernels_impl):
    mlp = SwiGLUMLP(32, 80).to(torch.bfloat16)
    mlp.kernels = kernels_impl
    x = randn(5, 32, dtype=torch.bfloat16, device="cpu", seed=3)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    assert torch.equal(mlp(x), mlp.down_proj(F.silu(gate) * up))
