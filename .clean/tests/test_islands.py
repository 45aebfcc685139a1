"""eager_on_graph and break_graph on the CPU emulation (CI tier): forced splits, configuration, behaviour outside a
capture, nesting, bound methods, aliases and capture stubs."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import (
    CALLS,
    add_one,
    count,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg
from bcg.capture_rules import is_emulated_capturing
from bcg.graph import EagerStep

# ----------------------------------------------------------------------------------------------------------------
# break_graph: forced splits


def test_break_graph_forces_a_split_without_eager_work():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(3)
    with bcg.breakable_graph(g):
        h = x * 2
        bcg.break_graph()
        y = h + 1
    assert (g.num_segments, g.num_breaks) == (2, 1)
    x.fill_(5.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 11.0))


def test_break_graph_outside_a_capture_is_a_noop():
    assert bcg.break_graph() is None
    assert bcg.force_no_graph() is None


# ----------------------------------------------------------------------------------------------------------------
# eager_on_graph: configuration, outside a capture, nesting, methods, aliases


def test_outside_a_capture_the_decorated_function_is_plain():
    x = torch.ones(2)
    torch.testing.assert_close(add_one(x), torch.full((2,), 2.0))
    assert CALLS == {"add_one": 1}
    assert add_one.__name__ == "add_one" and add_one.__wrapped__ is not None
    assert add_one.__bcg_eager__ is True


def test_enable_false_returns_the_function_itself():
    def f(x):
        return x

    assert bcg.eager_on_graph(enable=False)(f) is f
    assert bcg.eager_on_graph(f, enable=False) is f
    assert bcg.eager_on_graph(enable=True)(f) is not f


def test_disabled_eager_function_is_captured_into_the_segment():
    @bcg.eager_on_graph(enable=False)
    def plus(x):
        count("plus")
        return x + 1

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        y = plus(x) * 2
    assert (g.num_segments, g.num_breaks) == (1, 0)
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 6.0))
    assert CALLS == {"plus": 1}  # captured once, never re-run in Python


def test_aliases():
    assert bcg.no_graph is bcg.eager_on_graph
    assert bcg.force_no_graph is bcg.break_graph
    assert bcg.is_in_breakable_graph is bcg.is_capturing

    @bcg.no_graph
    def triple(x):
        return x * 3

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(2)
    with bcg.breakable_graph(g):
        y = triple(x + 1)
        bcg.force_no_graph()
        z = y + 1
    assert (g.num_segments, g.num_breaks) == (2, 2)
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(z, torch.full((2,), 13.0))


def test_configured_decorator_without_options():
    @bcg.eager_on_graph()
    def plus(x):
        return x + 1

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with bcg.breakable_graph(g):
        y = plus(x) * 2
    assert g.num_breaks == 1
    x.fill_(1.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((2,), 4.0))


def test_is_capturing_inside_and_outside():
    seen = []

    @bcg.eager_on_graph
    def probe(x):
        seen.append((bcg.is_capturing(), is_emulated_capturing()))
        return x

    assert not bcg.is_capturing()
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with bcg.breakable_graph(g):
        assert bcg.is_capturing() and is_emulated_capturing()
        probe(x * 1)
    assert not bcg.is_capturing()
    g.replay()
    # at capture: inside the capture, but not inside a segment; at replay: plain call
    assert seen == [(True, False), (False, False)]


def test_eager_function_calling_another_runs_it_plainly():
    @bcg.eager_on_graph
    def outer(x):
        count("outer")
        return add_one(x) * 2  # nested eager call: no extra break

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        y = outer(x * 1) + 1
    assert (g.num_segments, g.num_breaks) == (2, 1)
    assert [s.name for s in g.steps if isinstance(s, EagerStep)] == [outer.__qualname__]
    x.fill_(4.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 11.0))
    assert CALLS == {"outer": 2, "add_one": 2}


def test_break_graph_inside_an_eager_function_is_a_noop():
    @bcg.eager_on_graph
    def outer(x):
        bcg.break_graph()
        return x + 1

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with bcg.breakable_graph(g):
        outer(x * 1) * 2
    assert g.num_breaks == 1


class _Layer:
    def __init__(self, scale: float) -> None:
        self.w = torch.full((3,), scale)

    @bcg.eager_on_graph
    def scaled(self, x):
        return x * self.w

    def plain(self, x):
        return x - self.w


def test_decorated_bound_methods():
    a, b = _Layer(2.0), _Layer(3.0)
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(3)
    with bcg.breakable_graph(g):
        y = b.scaled(a.scaled(x + 0)) + 1
    assert g.num_breaks == 2
    assert all(s.name == "_Layer.scaled" for s in g.steps if isinstance(s, EagerStep))
    x.fill_(2.0)
    a.w.fill_(5.0)  # eager functions read their state at replay
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 2.0 * 5.0 * 3.0 + 1))


def test_decorating_a_bound_method_object():
    layer = _Layer(4.0)
    eager_plain = bcg.eager_on_graph(layer.plain)
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        y = eager_plain(x * 2) * 10
    assert g.num_breaks == 1
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 20.0))


# ----------------------------------------------------------------------------------------------------------------
# capture_stub


def test_capture_stub_runs_at_capture_and_the_real_function_at_replay():
    log = []

    def stub(x):
        log.append("stub")
        return torch.zeros(2, x.shape[0])  # the stub's shape defines the boundary buffer

    @bcg.eager_on_graph(capture_stub=stub)
    def gather(x):
        log.append("real")
        return torch.stack([x, x * 10])

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        y = gather(x + 1) + 1
    assert log == ["stub"]
    torch.testing.assert_close(y, torch.ones(2, 3))  # capture saw the stub's zeros
    boundary = next(s for s in g.steps if isinstance(s, EagerStep)).boundary
    assert boundary.buffers[0].shape == (2, 3)
    x.fill_(1.0)
    g.replay()
    assert log == ["stub", "real"]
    torch.testing.assert_close(y, torch.tensor([[3.0] * 3, [21.0] * 3]))
    # outside a capture the real function runs
    torch.testing.assert_close(gather(torch.ones(3)), torch.tensor([[1.0] * 3, [10.0] * 3]))
    assert log[-1] == "real"


def test_capture_stub_with_a_different_shape_than_the_real_function_raises_at_replay():
    @bcg.eager_on_graph(capture_stub=lambda x: torch.zeros(4))
    def real(x):
        return x + 1

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    with bcg.breakable_graph(g):
        real(x * 1)
    with pytest.raises(bcg.BoundaryMismatchError, match=r"shape=\[4\].*\n.*shape=\[3\]"):
        g.replay()
