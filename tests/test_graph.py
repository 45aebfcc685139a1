"""BreakableCUDAGraph and its steps on the CPU emulation (CI tier): segments and breaks, replay and a failing
replay, lifetime of what crosses a break, pools.

Capture and its failures, island marking, boundary buffers, emulation fidelity and stream tracking have their own
files.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from graph_helpers import (
    CALLS,
    add_one,
    capture_simple,
    check_simple,
    double_into,
    noop,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg
from bcg.graph import EagerStep

# ----------------------------------------------------------------------------------------------------------------
# basics: 0, 1 and many breaks


def test_defaults_to_emulation_without_cuda():
    g = bcg.BreakableCUDAGraph()
    assert g.is_emulated == (not torch.cuda.is_available())
    assert bcg.BreakableCUDAGraph(emulate=True).device_type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_emulate_false_without_cuda_is_a_clear_error():
    with pytest.raises(bcg.CaptureError, match="emulate=False"):
        bcg.BreakableCUDAGraph(emulate=False)


def test_zero_breaks_is_one_segment_and_replays_new_inputs():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(5)
    with bcg.breakable_graph(g) as entered:
        y = torch.sin(x) * 2 + 1
    assert entered is g
    assert (g.num_segments, g.num_breaks) == (1, 0)
    x.copy_(torch.linspace(-1, 1, 5))
    g.replay()
    torch.testing.assert_close(y, torch.sin(x) * 2 + 1)


def test_one_break_replays_new_inputs():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    out = capture_simple(g, x)
    assert (g.num_segments, g.num_breaks) == (2, 1)
    check_simple(g, x, out)


@pytest.mark.parametrize("n_breaks", [0, 1, 2, 7, 32])
def test_many_breaks_match_eager(n_breaks):
    def step(x, buf):
        h = x
        for i in range(n_breaks):
            h = h * 1.5 + i
            if i % 2:
                h = add_one(h)
            else:
                double_into(h, buf)
                h = buf + h
        return h - 1

    x, buf = torch.randn(8), torch.empty(8)
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        out = step(x, buf)
    assert g.num_breaks == n_breaks
    assert g.num_segments == n_breaks + 1
    for _ in range(3):
        x.copy_(torch.randn(8))
        g.replay()
        torch.testing.assert_close(out, step(x.clone(), torch.empty(8)))


def test_steps_alternate_in_capture_order():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(3)
    with bcg.breakable_graph(g):
        h = add_one(x * 2)
        noop()
        h = h * 3
    kinds = ["break" if isinstance(s, EagerStep) else "segment" for s in g.steps]
    assert kinds == ["segment", "break", "break", "segment"]
    names = [s.name for s in g.steps if isinstance(s, EagerStep)]
    assert names == ["add_one", "noop"]


def test_eager_function_runs_once_at_capture_and_once_per_replay():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(3)
    capture_simple(g, x)
    assert CALLS == {"add_one": 1}
    for _ in range(4):
        g.replay()
    assert CALLS == {"add_one": 5}


def test_kwargs_are_recorded_and_replayed():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x, out = torch.ones(3), torch.zeros(3)
    with bcg.breakable_graph(g):
        double_into(x + 1, out=out)
        y = out * 10
    x.fill_(4.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 100.0))


def test_num_segments_and_num_breaks_are_read_only():
    g = bcg.BreakableCUDAGraph(emulate=True)
    with pytest.raises(AttributeError):
        g.num_segments = 3
    with pytest.raises(AttributeError):
        g.num_breaks = 3


def test_replay_before_capture_raises():
    with pytest.raises(RuntimeError, match="before a successful capture"):
        bcg.BreakableCUDAGraph(emulate=True).replay()


def test_invalid_capture_error_mode_is_rejected():
    with pytest.raises(ValueError, match="capture_error_mode"):
        bcg.breakable_graph(bcg.BreakableCUDAGraph(emulate=True), capture_error_mode="strict")


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_error_modes_are_accepted(mode):
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with bcg.breakable_graph(g, capture_error_mode=mode):
        out = add_one(x * 2) * 3
    check_simple(g, x, out)


# ----------------------------------------------------------------------------------------------------------------
# segment bookkeeping: consecutive breaks, breaks at the edges, forced splits


@pytest.mark.parametrize(
    "pattern, segments, breaks",
    [
        ("B", 0, 1),  # only a break
        ("BB", 0, 2),
        ("BK", 1, 1),  # break at the start
        ("KB", 1, 1),  # break at the end
        ("KBK", 2, 1),
        ("KBBK", 2, 2),  # consecutive breaks: no empty segment between them
        ("KBBBBK", 2, 4),
        ("BKBKB", 2, 3),
        ("KBKBKBK", 4, 3),
    ],
)
def test_empty_segments_are_not_kept(pattern, segments, breaks):
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with bcg.breakable_graph(g):
        for c in pattern:
            if c == "K":
                x.add_(1)
            else:
                noop()
    assert (g.num_segments, g.num_breaks) == (segments, breaks)
    # the replay does the same work as the capture
    x.zero_()
    g.replay()
    torch.testing.assert_close(x, torch.full((4,), float(pattern.count("K"))))
    assert CALLS["noop"] == 2 * breaks


def test_views_alone_make_no_segment():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.arange(6.0)
    with bcg.breakable_graph(g):
        v = x.view(2, 3)
        noop()
        y = v.t() * 2
    assert (g.num_segments, g.num_breaks) == (1, 1)
    x.fill_(1.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3, 2), 2.0))



def _flaky_island():
    """An island that raises "replay boom" while ``fail["on"]`` is set."""
    fail = {"on": False}

    @bcg.eager_on_graph
    def flaky(x):
        if fail["on"]:
            raise RuntimeError("replay boom")
        return x + 1

    return fail, flaky


def test_exception_during_replay_propagates_and_the_next_replay_is_correct():
    fail, flaky = _flaky_island()
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        y = flaky(x * 2) * 3
    fail["on"] = True
    x.fill_(100.0)
    with pytest.raises(RuntimeError, match="replay boom"):
        g.replay()
    fail["on"] = False
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 15.0))
    assert not bcg.is_capturing()


def test_a_draining_replay_launches_the_remaining_segments_and_skips_their_eager_steps():
    fail, flaky = _flaky_island()
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        mid = flaky(x * 2)
        late = x * 5  # the segment after the failing island: a draining replay still runs it
        out = add_one(mid * 3)
    g.replay_draining()
    torch.testing.assert_close(out, torch.full((3,), 4.0))
    assert CALLS["add_one"] == 2  # capture and one replay
    fail["on"] = True
    x.fill_(2.0)
    with pytest.raises(RuntimeError, match="replay boom"):
        g.replay_draining()
    torch.testing.assert_close(late, torch.full((3,), 10.0))  # the segment after the island ran
    assert CALLS["add_one"] == 2  # the eager step after the failure was skipped
    with pytest.raises(RuntimeError, match="replay boom"):
        g.replay()  # a plain replay stops at the failure
    fail["on"] = False
    g.replay_draining()
    torch.testing.assert_close(out, torch.full((3,), 16.0))


# ----------------------------------------------------------------------------------------------------------------
# lifetime


def test_tensors_crossing_a_break_live_as_long_as_the_graph():
    refs: list[weakref.ref] = []

    @bcg.eager_on_graph
    def keep(t):
        refs.append(weakref.ref(t))
        return t * 2

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(3)

    def step():
        tmp = x + 1  # only the eager step references it after step() returns
        return keep(tmp) + 1

    with bcg.breakable_graph(g):
        out = step()
    gc.collect()
    arg_ref = refs[0]
    assert arg_ref() is not None
    step_obj = next(s for s in g.steps if isinstance(s, EagerStep))
    assert step_obj.args[0] is arg_ref()
    result_ref = weakref.ref(step_obj.boundary.buffers[0])
    del step_obj
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(out, torch.full((3,), 7.0))
    g.reset()
    gc.collect()
    assert arg_ref() is None and result_ref() is None  # reset releases them: no leak


# ----------------------------------------------------------------------------------------------------------------
# pools


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


@bcg.eager_on_graph
def _churn_eager(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 0.5


@bcg.eager_on_graph
def _churn_inplace(t: torch.Tensor) -> None:
    t.mul_(1.25).add_(0.1)


def _churn_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # intermediates are freed when they go out of scope
    h = _churn_eager(h + 1)
    t = (h * 2).relu()
    _churn_inplace(t)
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
