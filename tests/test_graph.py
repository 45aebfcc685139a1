"""BreakableCUDAGraph capture/replay semantics, run on the CPU emulation (CI tier).

Covers segments and breaks, eager_on_graph configuration, barrier ordering, error paths, lifetime, pool sharing,
threads and inference mode. Boundary buffers, emulation fidelity and stream tracking have their own files.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import bcg
from bcg.capture_rules import is_emulated_capturing
from bcg.graph import EagerStep

# ----------------------------------------------------------------------------------------------------------------
# eager functions used across the tests


CALLS: dict[str, int] = {}


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


@pytest.fixture(autouse=True)
def _reset_calls():
    CALLS.clear()
    yield
    assert not bcg.is_capturing(), "a test left a capture running"
    assert _get_current_dispatch_mode() is None, "a test left a dispatch mode pushed"


@bcg.eager_on_graph
def add_one(x: torch.Tensor) -> torch.Tensor:
    _count("add_one")
    return x + 1


@bcg.eager_on_graph
def double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    _count("double_into")
    torch.mul(x, 2, out=out)


@bcg.eager_on_graph
def noop() -> None:
    _count("noop")


def _assert_clean(g: bcg.BreakableCUDAGraph) -> None:
    """No debris after a failed capture: graph reset, no capture state, no recording mode left."""
    assert not bcg.is_capturing()
    assert not is_emulated_capturing()
    assert _get_current_dispatch_mode() is None
    assert not g.is_captured
    assert g.num_segments == 0 and g.num_breaks == 0
    with pytest.raises(RuntimeError, match="before a successful capture"):
        g.replay()


def _capture_simple(g: bcg.BreakableCUDAGraph, x: torch.Tensor) -> torch.Tensor:
    with bcg.breakable_graph(g):
        out = add_one(x * 2) * 3
    return out


def _check_simple(g: bcg.BreakableCUDAGraph, x: torch.Tensor, out: torch.Tensor) -> None:
    for v in (1.0, -2.5, 7.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, (x * 2 + 1) * 3)


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
    out = _capture_simple(g, x)
    assert (g.num_segments, g.num_breaks) == (2, 1)
    _check_simple(g, x, out)


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
    _capture_simple(g, x)
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
    _check_simple(g, x, out)


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
        _count("plus")
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
        _count("outer")
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


# ----------------------------------------------------------------------------------------------------------------
# barrier_fn


def test_barrier_runs_after_the_segment_ended_and_before_the_eager_function():
    log = []
    g = bcg.BreakableCUDAGraph(emulate=True)

    def barrier():
        log.append(("barrier", is_emulated_capturing(), g.num_segments))

    @bcg.eager_on_graph
    def work(x):
        log.append(("fn", is_emulated_capturing(), g.num_segments))
        return x + 1

    x = torch.zeros(3)
    with bcg.breakable_graph(g, barrier_fn=barrier):
        h = x * 2
        log.append(("segment", is_emulated_capturing(), g.num_segments))
        h = work(h)
        h = work(h * 3)
        bcg.break_graph()
        h = h + 1
    assert log == [
        ("segment", True, 0),
        ("barrier", False, 1),  # segment 1 already ended and was kept
        ("fn", False, 1),
        ("barrier", False, 2),
        ("fn", False, 2),
        ("barrier", False, 2),  # forced breaks get a barrier too; the empty segment before it was dropped
    ]
    log.clear()
    g.replay()
    assert log == [("fn", False, 3), ("fn", False, 3)]  # barriers are a capture-time affair


def test_a_failing_barrier_fails_the_capture():
    def barrier():
        raise OSError("rank 3 is gone")

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with pytest.raises(OSError, match="rank 3"):
        with bcg.breakable_graph(g, barrier_fn=barrier):
            add_one(x * 2)
    assert "add_one" not in CALLS
    _assert_clean(g)


# ----------------------------------------------------------------------------------------------------------------
# errors leave no debris


def test_exception_in_an_eager_function_resets_and_propagates():
    @bcg.eager_on_graph
    def broken(x):
        raise KeyError("eager boom")

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with pytest.raises(KeyError, match="eager boom"):
        with bcg.breakable_graph(g):
            h = add_one(x * 2)
            broken(h)
            h * 3
    _assert_clean(g)
    out = _capture_simple(g, x)  # the same graph captures again
    _check_simple(g, x, out)


def test_exception_in_a_segment_resets_and_propagates():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with pytest.raises(ZeroDivisionError, match="segment boom"):
        with bcg.breakable_graph(g):
            h = add_one(x * 2)
            h = h * 3
            raise ZeroDivisionError("segment boom")
    _assert_clean(g)
    assert torch.Tensor.tolist(torch.ones(1)) == [1.0]  # emulation guards were removed
    out = _capture_simple(g, x)
    _check_simple(g, x, out)


def test_uncapturable_op_in_a_segment_resets_and_propagates():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(4)
    with pytest.raises(bcg.UncapturableOpError, match="item"):
        with bcg.breakable_graph(g):
            h = add_one(x)
            h.sum().item()
    _assert_clean(g)
    out = _capture_simple(g, x)
    _check_simple(g, x, out)


def test_swallowed_eager_exception_still_fails_the_capture():
    @bcg.eager_on_graph
    def broken(x):
        raise KeyError("eager boom")

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with pytest.raises(bcg.CaptureError, match="failed inside an eager function") as info:
        with bcg.breakable_graph(g):
            try:
                broken(x * 2)
            except KeyError:
                pass
            x + 1
    assert isinstance(info.value.__cause__, KeyError)
    _assert_clean(g)
    out = _capture_simple(g, x)
    _check_simple(g, x, out)


def test_eager_call_after_a_swallowed_failure_raises():
    @bcg.eager_on_graph
    def broken(x):
        raise KeyError("eager boom")

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with pytest.raises(bcg.CaptureError, match="already failed before"):
        with bcg.breakable_graph(g):
            try:
                broken(x)
            except KeyError:
                pass
            add_one(x)
    assert "add_one" not in CALLS
    _assert_clean(g)


def test_swallowed_uncapturable_op_still_fails_the_capture():
    # On CUDA an illegal call invalidates the capture even if Python catches the error.
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(4)
    with pytest.raises(bcg.UncapturableOpError, match="invalidated"):
        with bcg.breakable_graph(g):
            h = add_one(x)
            try:
                h.sum().item()
            except bcg.UncapturableOpError:
                pass
            h * 2
    _assert_clean(g)
    out = _capture_simple(g, x)
    _check_simple(g, x, out)


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


def test_nested_capture_raises_a_clear_error():
    outer, inner = bcg.BreakableCUDAGraph(emulate=True), bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with pytest.raises(bcg.CaptureError, match="nested"):
        with bcg.breakable_graph(outer):
            x * 2
            with bcg.breakable_graph(inner):
                x * 3
    _assert_clean(outer)
    _assert_clean(inner)
    out = _capture_simple(inner, x)
    _check_simple(inner, x, out)


def test_capture_started_inside_an_eager_function_raises():
    inner = bcg.BreakableCUDAGraph(emulate=True)

    @bcg.eager_on_graph
    def sneaky(x):
        with bcg.breakable_graph(inner):
            x * 2
        return x

    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with pytest.raises(bcg.CaptureError, match="nested"):
        with bcg.breakable_graph(g):
            sneaky(x + 1)
    _assert_clean(g)
    _assert_clean(inner)


def test_capturing_into_a_captured_graph_requires_reset():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    out = _capture_simple(g, x)
    with pytest.raises(bcg.CaptureError, match="reset"):
        with bcg.breakable_graph(g):
            x * 5
    assert not bcg.is_capturing()
    _check_simple(g, x, out)  # the first capture is untouched


def test_reset_and_recapture():
    g = bcg.BreakableCUDAGraph(emulate=True)
    pool = g.pool()
    x = torch.zeros(3)
    _capture_simple(g, x)
    g.reset()
    assert not g.is_captured and g.num_segments == 0 and g.num_breaks == 0
    assert g.pool() == pool  # the pool handle survives a reset
    with pytest.raises(RuntimeError, match="before a successful capture"):
        g.replay()
    with bcg.breakable_graph(g):
        y = add_one(x - 1) * 7
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 21.0))


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


# ----------------------------------------------------------------------------------------------------------------
# threads and inference mode


def test_two_threads_capture_and_replay_different_graphs_concurrently():
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []
    capturing_seen: dict[int, list[bool]] = {0: [], 1: []}

    @bcg.eager_on_graph
    def plus(x, i):
        capturing_seen[i].append(bcg.is_capturing())
        barrier.wait()  # both threads are inside an eager function of their own capture
        return x + 1

    def worker(i: int) -> None:
        try:
            x = torch.full((4,), float(i))
            g = bcg.BreakableCUDAGraph(emulate=True)
            with bcg.breakable_graph(g):
                h = x * 2
                barrier.wait()  # both threads are inside a segment at the same time
                h = h + i
                h = plus(h, i) * 3
                barrier.wait()
                out = h - i
            assert (g.num_segments, g.num_breaks) == (2, 1)
            for k in range(10):
                x.fill_(float(k * (i + 1)))
                g.replay()  # replays interleave with the other thread's
                torch.testing.assert_close(out, ((x * 2 + i) + 1) * 3 - i)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert capturing_seen == {0: [True] + [False] * 10, 1: [True] + [False] * 10}


def test_another_thread_is_not_capturing_during_a_capture():
    results = {}
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(2)

    def other():
        results["capturing"] = bcg.is_capturing()
        results["tolist"] = x.tolist()  # host reads are legal outside this thread's capture

    with bcg.breakable_graph(g):
        y = x * 2
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert results == {"capturing": False, "tolist": [1.0, 1.0]}
    g.replay()
    torch.testing.assert_close(y, torch.full((2,), 2.0))


@pytest.mark.parametrize("replay_in_inference_mode", [True, False])
def test_inference_mode_capture_and_replay(replay_in_inference_mode):
    with torch.inference_mode():
        x = torch.zeros(4)
        buf = torch.zeros(4)
        g = bcg.BreakableCUDAGraph(emulate=True)
        with bcg.breakable_graph(g):
            h = add_one(x * 2)  # boundary buffer made in inference mode
            double_into(h, buf)  # in-place into an inference tensor
            y = buf + h
    for v in (1.0, 3.0):
        with torch.inference_mode():
            x.fill_(v)  # x is an inference tensor
        with torch.inference_mode(replay_in_inference_mode):
            g.replay()
        torch.testing.assert_close(y, torch.full((4,), 3 * (2 * v + 1)))


def test_no_grad_capture_and_replay():
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        x = torch.zeros(3)
        g = bcg.BreakableCUDAGraph(emulate=True)
        with bcg.breakable_graph(g):
            y = add_one(x * w) * w
    x.fill_(2.0)
    with torch.no_grad():
        g.replay()
    torch.testing.assert_close(y, torch.full((3,), 3.0))
