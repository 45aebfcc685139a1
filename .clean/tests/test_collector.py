"""No garbage collection mid-capture (CI tier, on the CPU emulation): destroying a captured graph while another
capture is underway invalidates that capture, as cudaGraphExecDestroy does on a GPU, so a capture holds the
collector off; garbage from before it waits until after."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from graph_helpers import (
    add_one,
    capture_simple,
    check_simple,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg
from bcg import collector
from bcg.emulation import EmulatedGraph, UncapturableOpError


def _captured_garbage() -> None:
    """Leaves a captured breakable graph reachable only through a reference cycle (as an exception's traceback
    keeps one): the next collection destroys its segments."""
    g = bcg.BreakableCUDAGraph(emulate=True)
    capture_simple(g, torch.zeros(4))
    cycle: dict = {"graph": g}
    cycle["self"] = cycle


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_graph_destroyed_mid_capture_invalidates_it_as_on_a_gpu(collector_on):
    _captured_garbage()
    seg = EmulatedGraph()
    x = torch.ones(4)
    seg.capture_begin()
    y = x * 2
    gc.collect()  # what an automatic collection would do at any allocation of the capture
    with pytest.raises(UncapturableOpError, match="reset or destroyed during this capture"):
        seg.capture_end()
    del y


def test_a_relaxed_capture_is_not_invalidated(collector_on):
    _captured_garbage()
    seg = EmulatedGraph()
    seg.capture_begin(capture_error_mode="relaxed")
    gc.collect()
    seg.capture_end()  # no error


def test_a_breakable_capture_holds_the_collector_off_and_garbage_waits(collector_on):
    _captured_garbage()
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(4)
    with bcg.breakable_graph(g):
        assert not gc.isenabled()
        h = add_one(x * 2)
        for _ in range(5000):  # past the collector's thresholds: it would have run without the hold
            junk: list = []
            junk.append(junk)
        out = h * 3
    assert gc.isenabled()
    assert gc.collect() > 0  # the garbage graph was still there, collected after the capture
    for v in (1.0, 4.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, (x * 2 + 1) * 3)


def test_a_failed_capture_turns_the_collector_back_on(collector_on):
    g = bcg.BreakableCUDAGraph(emulate=True)
    with pytest.raises(KeyError):
        with bcg.breakable_graph(g):
            raise KeyError("boom")
    assert gc.isenabled()
    x = torch.zeros(4)
    out = capture_simple(g, x)
    check_simple(g, x, out)


def test_a_collector_that_was_off_stays_off():
    was = gc.isenabled()
    gc.disable()
    try:
        capture_simple(bcg.BreakableCUDAGraph(emulate=True), torch.zeros(4))
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_the_last_of_two_threads_capturing_turns_it_back_on(collector_on):
    collector.hold()  # a capture underway on another thread
    try:
        capture_simple(bcg.BreakableCUDAGraph(emulate=True), torch.zeros(4))
        assert not gc.isenabled()  # this one ended, the other has not
    finally:
        collector.release()
    assert gc.isenabled()
    done = threading.Event()

    def other() -> None:
        capture_simple(bcg.BreakableCUDAGraph(emulate=True), torch.zeros(4))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert done.is_set() and gc.isenabled()
