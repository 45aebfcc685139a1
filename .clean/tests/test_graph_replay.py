"""A failing replay on the CPU emulation (CI tier): an eager step that raises at replay propagates and the next
replay is correct; a draining replay launches the remaining segments and skips their eager steps."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import (
    CALLS,
    add_one,
    flaky_island,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg


def test_exception_during_replay_propagates_and_the_next_replay_is_correct():
    fail, flaky = flaky_island()
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
    fail, flaky = flaky_island()
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
