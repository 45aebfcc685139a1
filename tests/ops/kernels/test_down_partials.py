"""The down projection's split-K partials (bcg.ops.kernels.down_partials): when they are made, that they sum to the
projection, that a dense model hands them to the next add + RMSNorm and to its last add, and that the model computes
the same with them as without (CPU: the fp32 stand-in of the same views)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from bcg import env
from bcg.models.config import get_preset
from bcg.models.layers import SwiGLUMLP
from bcg.models.registry import build_model
from bcg.ops import kernels

# The module itself (the package re-exports its function under the same name).
module = importlib.import_module("bcg.ops.kernels.down_partials")


def test_partials_sum_to_the_projection_from_views_of_the_inputs() -> None:
    x, w = torch.randn(7, 256, dtype=torch.float64), torch.randn(48, 256, dtype=torch.float64)
    xs, ws = module.split_views(x, w, 4)
    assert xs.data_ptr() == x.data_ptr() and ws.data_ptr() == w.data_ptr()  # no copy of either
    parts = kernels.down_partials(x.float(), w.float(), 4)
    assert parts.shape == (4, 7, 48) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.double().sum(0), x @ w.T, rtol=1e-5, atol=1e-4)


def test_num_splits_is_the_one_predicate(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(64, 2816, dtype=torch.bfloat16)
    x = torch.randn(module.MAX_ROWS, 2816, dtype=torch.bfloat16)
    assert kernels.num_splits(x, w, "fused") == module.NUM_SPLITS
    assert kernels.num_splits(torch.randn(module.MAX_ROWS + 1, 2816, dtype=torch.bfloat16), w, "fused") == 0
    assert kernels.num_splits(x.float(), w.float(), "fused") == 0  # fp32 keeps its one GEMM
    assert kernels.num_splits(x, w, "torch") == 0  # the torch kernels keep F.linear
    assert kernels.num_splits(x[:, :2800], w[:, :2800], "fused") == 0  # K slices would not align
    assert kernels.num_splits(torch.randn(0, 2816, dtype=torch.bfloat16), w, "fused") == 0
    assert kernels.num_splits(torch.randn(8, 5632, dtype=torch.bfloat16)[:, ::2], w, "fused") == 0  # no view
    monkeypatch.setattr(env, "DOWN_PARTIALS", False)
    assert kernels.num_splits(x, w, "fused") == 0


def test_fused_add_rms_norm_sums_the_partials_and_rounds_once() -> None:
    parts = torch.randn(4, 5, 64)
    residual = torch.randn(5, 64, dtype=torch.bfloat16)
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    normed, summed = kernels.fused_add_rms_norm(parts, residual.clone(), w, 1e-6)
    want = (parts.double().sum(0) + residual.double()).to(torch.bfloat16)
    assert normed.shape == residual.shape and normed.dtype == torch.bfloat16
    torch.testing.assert_close(summed, want, rtol=0, atol=0)  # one rounding of the fp32 sum
    torch.testing.assert_close(normed, F.rms_norm(want.float(), (64,), w.float(), 1e-6).to(torch.bfloat16))
    with pytest.raises(ValueError, match="must be float32"):
        kernels.fused_add_rms_norm(parts.to(torch.bfloat16), residual, w, 1e-6)


@torch.no_grad()
def test_a_dense_mlp_leaves_partials_only_where_asked_and_under_the_rows() -> None:
    mlp = SwiGLUMLP(64, 256).to(torch.bfloat16)
    mlp.kernels = "fused"
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    plain = mlp(x)
    assert plain.shape == (16, 64)  # not asked: one output
    mlp.emits_partials = True
    parts = mlp(x)
    assert parts.shape == (module.NUM_SPLITS, 16, 64) and parts.dtype == torch.float32
    scale = float(plain.abs().max())
    torch.testing.assert_close(parts.sum(0).to(torch.bfloat16), plain, rtol=2**-7, atol=2**-7 * scale)
    assert mlp(torch.randn(module.MAX_ROWS + 1, 64, dtype=torch.bfloat16)).shape == (module.MAX_ROWS + 1, 64)


@pytest.mark.parametrize("tokens", [12, module.MAX_ROWS + 3])
def test_a_dense_model_computes_the_same_with_partials_as_without(monkeypatch: pytest.MonkeyPatch,
                                                                  tokens: int) -> None:
    model = build_model(get_preset("tiny-dense")).to(torch.bfloat16)
    model.set_kernels("fused")
    assert all(layer.mlp.emits_partials for layer in model.layers)
    hidden = torch.randn(tokens, model.config.hidden_size, dtype=torch.bfloat16)
    positions = torch.arange(tokens)
    seen: list[int] = []
    real = module.down_partials
    monkeypatch.setattr(kernels, "down_partials", lambda *a, **k: seen.append(1) or real(*a, **k))
    from bcg.ops.context import forward_context
    from bcg.runtime.batch import PrefillBatch, PrefillItem

    pool = model.make_kv_pool(2 * tokens + 8, "cpu", torch.bfloat16)
    batch = PrefillBatch([PrefillItem(torch.zeros(tokens, dtype=torch.long), pool.alloc(tokens))], pool)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(env, "DOWN_PARTIALS", on)
        seen.clear()
        with torch.no_grad(), forward_context(batch.to_context(tokens)):
            out = torch.empty_like(hidden)
            results[on] = model.forward_layers(hidden, positions, out=out)
            assert results[on] is out
        # Every layer's MLP left partials at a short prompt (the last one's summed by the stack's last add).
        assert len(seen) == (len(model.layers) if on and tokens <= module.MAX_ROWS else 0)
    scale = results[False].float().abs().max()
    torch.testing.assert_close(results[True].float(), results[False].float(), rtol=2**-6, atol=2**-6 * scale)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 64, module.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(2816, 1024), (8192, 2048)])
def test_cuda_partials_are_one_gemm_that_sums_to_the_projection_and_captures(rows: int, k: int, n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    splits = kernels.num_splits(x, w, "fused")
    assert splits == module.NUM_SPLITS
    ref = x.double() @ w.double().T
    parts = kernels.down_partials(x, w, splits)
    assert parts.dtype == torch.float32 and parts.shape == (splits, rows, n)
    # fp32 partials of bf16 products: far closer to fp64 than F.linear's bf16 output.
    assert (parts.double().sum(0) - ref).abs().max() <= 1e-4 * ref.abs().max()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.down_partials(x, w, splits)
        torch.cuda.synchronize()
    assert len([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]) == 1
    static = torch.empty_like(parts)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static.copy_(kernels.down_partials(x, w, splits))
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static.copy_(kernels.down_partials(x, w, splits))
    x.copy_(torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(static, kernels.down_partials(x, w, splits))
