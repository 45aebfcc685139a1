"""Eager functions and checks shared by the primitive's tests on the CPU emulation (test_graph, test_graph_replay,
test_graph_pools, test_capture, test_capture_errors, test_islands, test_boundary, test_boundary_mismatch,
test_emulation, test_capture_rules).

``reset_calls`` and ``no_debris`` are autouse fixtures: a module that imports one gets it for every test, so no test
can leave a capture running or a dispatch mode pushed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import bcg
from bcg.boundary import Boundary
from bcg.capture_rules import is_emulated_capturing
from bcg.graph import EagerStep

CALLS: dict[str, int] = {}


def count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


@pytest.fixture(autouse=True)
def reset_calls():
    CALLS.clear()
    yield
    assert not bcg.is_capturing(), "a test left a capture running"
    assert _get_current_dispatch_mode() is None, "a test left a dispatch mode pushed"


@pytest.fixture(autouse=True)
def no_debris():
    """After each test: no capture running, emulated or not, and no dispatch mode pushed (no call counts)."""
    yield
    assert not bcg.is_capturing() and not is_emulated_capturing()
    assert _get_current_dispatch_mode() is None


@bcg.eager_on_graph
def add_one(x: torch.Tensor) -> torch.Tensor:
    count("add_one")
    return x + 1


@bcg.eager_on_graph
def double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    count("double_into")
    torch.mul(x, 2, out=out)


@bcg.eager_on_graph
def noop() -> None:
    count("noop")


@bcg.eager_on_graph
def broken(x: torch.Tensor) -> torch.Tensor:
    raise KeyError("eager boom")


@bcg.eager_on_graph
def churn_eager(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 0.5


@bcg.eager_on_graph
def churn_inplace(t: torch.Tensor) -> None:
    t.mul_(1.25).add_(0.1)


def flaky_island():
    """An island that raises "replay boom" while ``fail["on"]`` is set."""
    fail = {"on": False}

    @bcg.eager_on_graph
    def flaky(x):
        if fail["on"]:
            raise RuntimeError("replay boom")
        return x + 1

    return fail, flaky


def assert_clean(g: bcg.BreakableCUDAGraph) -> None:
    """No debris after a failed capture: graph reset, no capture state, no recording mode left."""
    assert not bcg.is_capturing()
    assert not is_emulated_capturing()
    assert _get_current_dispatch_mode() is None
    assert not g.is_captured
    assert g.num_segments == 0 and g.num_breaks == 0
    with pytest.raises(RuntimeError, match="before a successful capture"):
        g.replay()


def capture_simple(g: bcg.BreakableCUDAGraph, x: torch.Tensor) -> torch.Tensor:
    with bcg.breakable_graph(g):
        out = add_one(x * 2) * 3
    return out


def check_simple(g: bcg.BreakableCUDAGraph, x: torch.Tensor, out: torch.Tensor) -> None:
    for v in (1.0, -2.5, 7.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, (x * 2 + 1) * 3)


def capture_emulated(fn, *inputs):
    """``fn(*inputs)`` captured into a fresh emulated graph; returns the graph and what ``fn`` returned."""
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        out = fn(*inputs)
    return g, out


def boundary_of(g: bcg.BreakableCUDAGraph, index: int = 0) -> Boundary:
    """The boundary of the ``index``-th eager step of ``g``."""
    return [s for s in g.steps if isinstance(s, EagerStep)][index].boundary


@dataclasses.dataclass
class Pair:
    """A dataclass an eager function returns: tensors and a baked string field."""

    a: torch.Tensor
    b: torch.Tensor
    tag: str = "pair"
