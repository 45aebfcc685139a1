"""Memory pools of BreakableCUDAGraph on real CUDA graphs (emulate=False): graphs sharing a pool never read each
other's memory, a pool outlives resets, dropped segments and deleted sharers, and a failed capture moves its graph to
a fresh pool."""

from __future__ import annotations

import pytest
import torch
from cuda_graph_helpers import (
    DEV,
    capture_simple,
    check_simple,
    churn_eager,
    churn_inplace,
    cuda_graph,
    no_stream_left_capturing,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# ----------------------------------------------------------------------------------------------------------------
# shared pools


def _churn_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # intermediates are freed when they go out of scope, so the pool reuses their blocks
    big = torch.empty(x.shape[0], 4096, device=x.device).fill_(0.5)
    h = churn_eager(h + big[:, : h.shape[1]])
    del big
    t = (h * 2).relu()
    churn_inplace(t)
    bcg.break_graph()
    scratch = torch.empty_like(t).fill_(0.25)  # more freed blocks, filled at replay
    return t.sum(-1, keepdim=True) + x[:, :1] + scratch[:, :1]


def test_graphs_sharing_a_pool_never_read_each_others_memory():
    gen = torch.Generator(device=DEV).manual_seed(0)
    w = torch.randn(64, 128, device=DEV, generator=gen)
    xa = torch.randn(512, 64, device=DEV, generator=gen)
    xb = torch.randn(16, 64, device=DEV, generator=gen)
    _churn_model(xa, w)  # warm up (cuBLAS handles) outside any capture
    torch.cuda.synchronize()
    ga = cuda_graph()
    gb = bcg.BreakableCUDAGraph(pool=ga.pool(), emulate=False)
    with bcg.breakable_graph(ga):
        ya = _churn_model(xa, w)
    with bcg.breakable_graph(gb, pool=ga.pool()):
        yb = _churn_model(xb, w)
    assert gb.pool() == ga.pool()
    order = "ABBAABABBBAAAB" * 3
    for name in order:
        x, g, y = (xa, ga, ya) if name == "A" else (xb, gb, yb)
        x.copy_(torch.randn(x.shape, device=DEV, generator=gen))
        g.replay()
        torch.testing.assert_close(y, _churn_model(x.clone(), w), rtol=1e-4, atol=1e-4)
    # each graph's last result survives the other's replay
    xa.copy_(torch.randn(xa.shape, device=DEV, generator=gen))
    ga.replay()
    expected_a = _churn_model(xa.clone(), w)
    gb.replay()
    torch.testing.assert_close(ya, expected_a, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# a pool's lifetime


def test_pool_survives_reset_dropped_segments_and_deleted_sharers():
    # torch retires a pool when its last CUDAGraph dies; a later capture into the same handle then fails an
    # internal assert. bcg keeps the pool alive for as long as any BreakableCUDAGraph using it lives.
    x = torch.zeros(16, device=DEV)
    a = cuda_graph()
    with bcg.breakable_graph(a):
        bcg.break_graph()  # the first segment is empty and dropped
        y = x + 1
    b = bcg.BreakableCUDAGraph(pool=a.pool(), emulate=False)
    out_b = capture_simple(b, x)
    del a, y
    b.reset()
    out_b = capture_simple(b, x)
    check_simple(b, x, out_b)


def test_failed_capture_moves_an_owned_graph_to_a_fresh_pool():
    # An invalidated capture leaves its pool "already recording" in torch, so the graph takes a new pool.
    x = torch.ones(16, device=DEV)
    g = cuda_graph()
    old = g.pool()
    with pytest.raises(RuntimeError):
        with bcg.breakable_graph(g):
            (x * 2).sum().item()
    assert g.pool() != old
    out = capture_simple(g, x)
    check_simple(g, x, out)
