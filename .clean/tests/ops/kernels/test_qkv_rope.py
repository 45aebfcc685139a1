"""The q/k/v projection with RoPE in its epilogue on the CPU: its dispatch rules, the two steps it stands for, and its
kernel under Triton's interpreter (``interpret_qkv_rope.py``, in a fresh process; on CUDA in
``test_qkv_rope_cuda.py``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import qkv_cases as cases
import torch
import torch.nn.functional as F
from interpreter import run_under_interpreter

from bcg import env
from bcg.ops import kernels
from bcg.ops.kernels import qkv_rope

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_off_the_gpu_it_is_the_projection_then_qkv_norm_rope(qk_norm, bias):
    x, w, positions, freqs = cases.model_inputs(6, 48, 4, 2, 32, "cpu", torch.float32)
    b = torch.randn(w.shape[0]) if bias else None
    norms = {"q_weight": torch.rand(32) + 0.5, "k_weight": torch.rand(32) + 0.5} if qk_norm else {}
    got = kernels.qkv_proj_rope(x, w, b, positions, freqs, 4, 2, eps=1e-5, **norms)
    expected = kernels.qkv_norm_rope(F.linear(x, w, b), positions, freqs, 4, 2, eps=1e-5, **norms)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_the_kv_write_and_the_outputs_are_the_two_steps_too():
    x, w, positions, freqs = cases.model_inputs(5, 48, 4, 2, 32, "cpu", torch.float32)
    caches = [torch.zeros(9, 2, 32) for _ in range(2)]
    slots = torch.tensor([8, 0, 3, 5, 1])
    outs = [torch.empty(5, n, 32) for n in (4, 2, 2)]
    kernels.qkv_proj_rope(x, w, None, positions, freqs, 4, 2, out=outs, cache=(*caches, slots))
    q, k, v = kernels.qkv_norm_rope(F.linear(x, w), positions, freqs, 4, 2)
    assert torch.equal(outs[0], q) and torch.equal(caches[0][slots], k) and torch.equal(caches[1][slots], v)


def test_one_kernel_only_for_short_half_precision_batches_of_splittable_heads(monkeypatch):
    def fused(rows=16, dtype=torch.bfloat16, dim=64, has_norm=False, bias=None):
        x = torch.zeros(rows, 32, dtype=dtype)
        return qkv_rope.is_fused(x, torch.zeros(8 * dim, 32, dtype=dtype), bias, dim, has_norm)

    assert fused() and fused(rows=1) and fused(dtype=torch.float16) and fused(dim=128, has_norm=True)
    assert not fused(rows=qkv_rope.MAX_FUSED_ROWS + 1) and not fused(rows=0)
    assert not fused(dtype=torch.float32)
    assert not fused(dim=80)  # a half head of 40: no 16-column blocks
    assert fused(dim=96) and not fused(dim=96, has_norm=True)  # a norm needs the half head as one power of two
    assert not fused(bias=torch.zeros(8 * 64))  # an fp32 bias beside bf16 operands
    monkeypatch.setattr(env, "QKV_FUSION", False)  # BCG_QKV_FUSION=off
    assert not fused()


@pytest.mark.parametrize(("value", "expected"), [("", "True"), ("ON", "True"), ("0", "False"), ("off", "False")])
def test_the_qkv_fusion_switch_is_read_once_and_checked(value, expected):
    """BCG_QKV_FUSION: unset is on; a value that is neither on nor off stops the import and says so."""
    code = "from bcg import env; print(env.QKV_FUSION)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BCG_QKV_FUSION": value})
    assert run.returncode == 0 and run.stdout.strip() == expected, run.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BCG_QKV_FUSION": "yes"})
    assert bad.returncode != 0 and "expected on or off" in bad.stderr


@pytest.mark.parametrize("rows,hidden,heads,dim,norm,sms", [(64, 2048, 48, 64, False, 132), (64, 1024, 24, 64, False,
                                                                                              132),
                                                           (16, 1024, 32, 128, True, 132), (5, 96, 8, 32, False, 4),
                                                           (64, 200, 3, 64, False, 132)])
def test_the_kernel_tiles_cover_each_half_head_and_k_once(rows, hidden, heads, dim, norm, sms):
    tk = pytest.importorskip("bcg.ops.kernels.triton_qkv_rope")
    plan = tk.tiling(rows, hidden, heads, dim, norm, sms)
    assert (dim // 2) % plan.half_n == 0 and (plan.half_n == dim // 2 if norm else plan.half_n == min(16, dim // 2))
    assert plan.block_m == (16 if rows <= 16 else 64)
    steps = -(-hidden // plan.block_k)
    assert (plan.split_k - 1) * plan.k_iters < steps <= plan.split_k * plan.k_iters  # every K step once, no empty split
    assert plan.tiles == -(-rows // plan.block_m) * heads * (dim // 2 // plan.half_n)
    assert plan.split_k == 1 or plan.split_k * plan.tiles <= 2 * sms + plan.tiles  # about two programs an SM


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: torch's CPU wheels do not bring it; pip install -e .[test] does")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernel")
@pytest.mark.interpreter(HERE / "interpret_qkv_rope.py")  # started when the session is collected
def test_the_kernel_under_the_interpreter_in_a_fresh_process():  # the launcher, whatever BCG_QKV_FUSION says
    run_under_interpreter(HERE / "interpret_qkv_rope.py", allow_skips=False)
