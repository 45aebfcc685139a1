"""BreakableCUDAGraph and its steps on the CPU emulation (CI tier): segments and breaks, replay, lifetime of what
crosses a break.

A failing replay, pools, capture and its failures, island marking, boundary buffers, emulation fidelity and stream
tracking have their own files.
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
