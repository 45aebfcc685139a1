"""Memory pools of BreakableCUDAGraph on the CPU emulation (CI tier): pool handles, and graphs sharing a pool never
reading each other's memory."""

from __future__ import annotations

import torch
from graph_helpers import (
    churn_eager,
    churn_inplace,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg


class _PoolLike:
    """Stands for a torch.cuda.MemPool, whose handle is its ``id``."""

    id = (0, 12345)


def test_pool_handles():
    a = bcg.BreakableCUDAGraph(emulate=True)
    b = bcg.BreakableCUDAGraph(pool=a.pool(), emulate=True)
    assert b.pool() == a.pool()
    assert bcg.BreakableCUDAGraph(emulate=True).pool() != a.pool()
    assert a.pool() == a.pool()  # stable
    assert bcg.BreakableCUDAGraph(pool=_PoolLike(), emulate=True).pool() == (0, 12345)


def _churn_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # intermediates are freed when they go out of scope
    h = churn_eager(h + 1)
    t = (h * 2).relu()
    churn_inplace(t)
    bcg.break_graph()
    return t.sum(-1, keepdim=True) + x[:, :1]


def test_graphs_sharing_a_pool_never_read_each_others_memory():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=gen)
    xa, xb = torch.randn(64, 16, generator=gen), torch.randn(8, 16, generator=gen)
    ga = bcg.BreakableCUDAGraph(emulate=True)
    gb = bcg.BreakableCUDAGraph(pool=ga.pool(), emulate=True)
    with bcg.breakable_graph(ga, pool=ga.pool()):
        ya = _churn_model(xa, w)
    with bcg.breakable_graph(gb, pool=ga.pool()):
        yb = _churn_model(xb, w)
    for name in "ABBAABABBBAAAB":
        x, g, y = (xa, ga, ya) if name == "A" else (xb, gb, yb)
        x.copy_(torch.randn(x.shape, generator=gen))
        g.replay()
        torch.testing.assert_close(y, _churn_model(x.clone(), w))
    # the last replay of each graph is still intact after the other replayed
    xa.copy_(torch.randn(xa.shape, generator=gen))
    ga.replay()
    gb.replay()
    torch.testing.assert_close(ya, _churn_model(xa.clone(), w))
