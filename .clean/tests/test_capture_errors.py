"""A failing capture on the CPU emulation (CI tier): an exception in an eager function or a segment, an uncapturable
op, a swallowed failure, a nested capture; each leaves no debris, and the same graph captures again."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import (
    CALLS,
    add_one,
    assert_clean,
    broken,
    capture_simple,
    check_simple,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg

# ----------------------------------------------------------------------------------------------------------------
# errors leave no debris


def test_exception_in_an_eager_function_resets_and_propagates():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with pytest.raises(KeyError, match="eager boom"):
        with bcg.breakable_graph(g):
            h = add_one(x * 2)
            broken(h)
            h * 3
    assert_clean(g)
    out = capture_simple(g, x)  # the same graph captures again
    check_simple(g, x, out)


def test_exception_in_a_segment_resets_and_propagates():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with pytest.raises(ZeroDivisionError, match="segment boom"):
        with bcg.breakable_graph(g):
            h = add_one(x * 2)
            h = h * 3
            raise ZeroDivisionError("segment boom")
    assert_clean(g)
    assert torch.Tensor.tolist(torch.ones(1)) == [1.0]  # emulation guards were removed
    out = capture_simple(g, x)
    check_simple(g, x, out)


def test_uncapturable_op_in_a_segment_resets_and_propagates():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.ones(4)
    with pytest.raises(bcg.UncapturableOpError, match="item"):
        with bcg.breakable_graph(g):
            h = add_one(x)
            h.sum().item()
    assert_clean(g)
    out = capture_simple(g, x)
    check_simple(g, x, out)


def test_swallowed_eager_exception_still_fails_the_capture():
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
    assert_clean(g)
    out = capture_simple(g, x)
    check_simple(g, x, out)


def test_eager_call_after_a_swallowed_failure_raises():
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
    assert_clean(g)


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
    assert_clean(g)
    out = capture_simple(g, x)
    check_simple(g, x, out)


# ----------------------------------------------------------------------------------------------------------------
# nesting


def test_nested_capture_raises_a_clear_error():
    outer, inner = bcg.BreakableCUDAGraph(emulate=True), bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(2)
    with pytest.raises(bcg.CaptureError, match="nested"):
        with bcg.breakable_graph(outer):
            x * 2
            with bcg.breakable_graph(inner):
                x * 3
    assert_clean(outer)
    assert_clean(inner)
    out = capture_simple(inner, x)
    check_simple(inner, x, out)


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
    assert_clean(g)
    assert_clean(inner)
