"""The q/k/v projection with RoPE in its epilogue on CUDA: the kernel against fp64 at odd sizes and at the llama and
Qwen3 shapes, with norms, bias and the KV write; its dispatch (one kernel up to its rows, the two steps past them or
with BCG_QKV_FUSION=off), capture and replay; and the q/k/v layers of native models (plain, Qwen3's per-head norms, a
bias) against the two steps; the variant with the layer's input add + RMSNorm in its prologue against fp64, its
entry point (one kernel up to its rows) and its replay. Run with ``python -m pytest -m cuda tests/ops/kernels``."""

from __future__ import annotations

import dataclasses

import pytest
import qkv_cases as cases
import qkv_prologue_cases as prologue
import torch
import torch.nn.functional as F

from bcg import env
from bcg.models.config import get_preset
from bcg.models.dense import QKVProjection
from bcg.models.layers import RotaryEmbedding
from bcg.ops import kernels
from bcg.ops.kernels import qkv_rope, triton_qkv_rope

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", cases.SHAPES + cases.LLAMA_SHAPES)
def test_kernel_matches_fp64(dtype, rows, hidden, heads, kv_heads, dim):
    cases.check_qkv_rope(cases.direct(triton_qkv_rope), DEV, dtype, rows, hidden, heads, kv_heads, dim)


@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", [(64, 1024, 16, 8, 128), (7, 200, 3, 1, 64)])
def test_norms_bias_and_the_kv_write_match_fp64(rows, hidden, heads, kv_heads, dim):
    cases.check_qkv_rope(cases.direct(triton_qkv_rope), DEV, torch.bfloat16, rows, hidden, heads, kv_heads, dim,
                         qk_norm=True, bias=True, cache=True)


@pytest.mark.parametrize("tiles", [{"half_n": 32}, {"block_m": 16}, {"block_k": 128, "num_warps": 8}, {"split_k": 1},
                                   {"split_k": 16, "block_k": 32}])
def test_other_tiles_match_fp64(tiles):
    cases.check_qkv_rope(cases.direct(triton_qkv_rope, **tiles), DEV, torch.bfloat16, 64, 2048, 32, 8, 64,
                         cache=True)


@pytest.mark.parametrize("rows", [1, 9, qkv_rope.MAX_FUSED_ROWS, qkv_rope.MAX_FUSED_ROWS + 1, 64])
def test_entry_point_runs_one_kernel_up_to_its_rows(rows):
    x, w, positions, freqs = cases.model_inputs(rows, 2048, 32, 8, 64, DEV, torch.bfloat16)
    two_steps = kernels.qkv_norm_rope(F.linear(x, w), positions, freqs, 32, 8)
    got = kernels.qkv_proj_rope(x, w, None, positions, freqs, 32, 8)
    if rows > qkv_rope.MAX_FUSED_ROWS:
        assert all(torch.equal(g, e) for g, e in zip(got, two_steps))  # the unfused path, unchanged
        return
    for g, e in zip(got, two_steps):  # the same products summed in another order than cuBLAS's
        torch.testing.assert_close(g.float(), e.float(), rtol=2**-7, atol=2**-7 * float(e.abs().max()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.qkv_proj_rope(x, w, None, positions, freqs, 32, 8)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names == ["_qkv_rope_kernel"], names


def test_capture_and_replay_follow_fresh_inputs():
    x, w, positions, freqs = cases.model_inputs(16, 1024, 16, 4, 64, DEV, torch.bfloat16)
    caches = [torch.zeros(100, 4, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.arange(16, device=DEV) * 3
    outs = [torch.empty(16, n, 64, device=DEV, dtype=torch.bfloat16) for n in (16, 4, 4)]
    kernels.qkv_proj_rope(x, w, None, positions, freqs, 16, 4, out=outs, cache=(*caches, slots))  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.qkv_proj_rope(x, w, None, positions, freqs, 16, 4, out=outs, cache=(*caches, slots))
    for seed in (1, 2):
        x.mul_(1 + 0.25 * seed)
        positions.add_(100)
        slots.add_(1)
        graph.replay()
        q, k, v = kernels.qkv_proj_rope(x, w, None, positions, freqs, 16, 4)
        assert torch.equal(outs[0], q) and torch.equal(caches[0][slots], k) and torch.equal(caches[1][slots], v)


@pytest.mark.parametrize("preset,changes", [("llama-dense", {}), ("llama-dense", {"qk_norm": True, "head_dim": 128}),
                                            ("gptoss-moe", {})])  # plain, Qwen3's per-head norms, a bias
def test_the_models_projection_matches_the_two_steps(preset, changes, monkeypatch):
    cfg = dataclasses.replace(get_preset(preset), **changes)
    proj = QKVProjection(cfg).to(DEV, torch.bfloat16)
    x = torch.randn(16, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(DEV).rope(torch.arange(16, device=DEV) + 5)
    results = {}
    for fusion in (True, False):
        monkeypatch.setattr(env, "QKV_FUSION", fusion)
        proj.kernels = "fused"
        with torch.no_grad():
            results[fusion] = [t.clone() for t in proj(x, rope)]
    for g, e in zip(results[True], results[False]):
        torch.testing.assert_close(g.float(), e.float(), rtol=2**-7, atol=2**-7 * float(e.abs().max()))


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", cases.LLAMA_SHAPES)
def test_the_prologue_variant_matches_fp64(rows, hidden, heads, kv_heads, dim, add):
    prologue.check_qkv_rope_norm(prologue.direct_norm(triton_qkv_rope), DEV, torch.bfloat16, rows, hidden, heads,
                                 kv_heads, dim, add=add)


@pytest.mark.parametrize("tiles", [{}, {"split_k": 1}, {"split_k": 16, "block_k": 32}])
@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", [(16, 1024, 16, 8, 128), (7, 200, 3, 1, 64)])
def test_the_prologue_with_norms_bias_and_the_kv_write_matches_fp64(rows, hidden, heads, kv_heads, dim, tiles):
    prologue.check_qkv_rope_norm(prologue.direct_norm(triton_qkv_rope, **tiles), DEV, torch.bfloat16, rows, hidden,
                                 heads, kv_heads, dim, qk_norm=True, bias=True, cache=True)


def prologue_inputs(rows: int) -> tuple:
    x, w, positions, freqs = cases.model_inputs(rows, 2048, 32, 8, 64, DEV, torch.bfloat16)
    residual = torch.randn(rows, 2048, device=DEV, dtype=torch.bfloat16) * 4
    norm_weight = torch.rand(2048, device=DEV, dtype=torch.bfloat16) + 0.5
    return x, w, positions, freqs, residual, norm_weight


@pytest.mark.parametrize("rows", [1, 9, qkv_rope.MAX_FUSED_ROWS, qkv_rope.MAX_FUSED_ROWS + 1])
def test_the_entry_point_with_the_prologue_runs_one_kernel_up_to_its_rows(rows):
    x, w, positions, freqs, residual, norm_weight = prologue_inputs(rows)
    x0, residual0 = x.clone(), residual.clone()
    normed, summed = kernels.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, 1e-6)
    two_steps = kernels.qkv_proj_rope(normed, w, None, positions, freqs, 32, 8)
    *got, new_residual = kernels.qkv_proj_rope(x, w, None, positions, freqs, 32, 8, residual=residual,
                                               norm_weight=norm_weight)
    assert torch.equal(x, x0) and torch.equal(residual, residual0), "x or residual changed"
    assert torch.equal(new_residual, summed), "the new residual is fused_add_rms_norm's sum, bit for bit"
    if rows > qkv_rope.MAX_FUSED_ROWS:
        assert all(torch.equal(g, e) for g, e in zip(got, two_steps))  # the steps themselves
        return
    for g, e in zip(got, two_steps):  # h * w_norm rounded instead of the normed rows, and another summation order
        torch.testing.assert_close(g.float(), e.float(), rtol=2**-7, atol=2**-7 * float(e.abs().max()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.qkv_proj_rope(x, w, None, positions, freqs, 32, 8, residual=residual, norm_weight=norm_weight)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names == ["_qkv_rope_kernel"], names


def test_the_prologue_in_a_graph_follows_fresh_inputs():
    x, w, positions, freqs, residual, norm_weight = prologue_inputs(16)
    caches = [torch.zeros(100, 8, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.arange(16, device=DEV) * 3
    outs = [torch.empty(16, n, 64, device=DEV, dtype=torch.bfloat16) for n in (32, 8, 8)]
    residual_out = torch.empty_like(residual)

    def layer_start() -> None:
        kernels.qkv_proj_rope(x, w, None, positions, freqs, 32, 8, out=outs, cache=(*caches, slots),
                              residual=residual, norm_weight=norm_weight, residual_out=residual_out)

    layer_start()  # compiles, and makes the tile counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer_start()
    for seed in (1, 2):
        x.mul_(1 + 0.25 * seed)
        residual.add_(0.5 * seed)
        norm_weight.mul_(0.75)
        positions.add_(100)
        slots.add_(1)
        graph.replay()
        q, k, v, h = kernels.qkv_proj_rope(x, w, None, positions, freqs, 32, 8, residual=residual,
                                           norm_weight=norm_weight)
        assert torch.equal(residual_out, h) and torch.equal(outs[0], q)
        assert torch.equal(caches[0][slots], k) and torch.equal(caches[1][slots], v)
