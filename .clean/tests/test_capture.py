"""breakable_graph, the capture, on the CPU emulation (CI tier): barrier ordering, recapture, threads and inference
mode.

Every failure leaving no debris, and nesting, have their own file (test_capture_errors).
"""

from __future__ import annotations

import threading

import pytest
import torch
from graph_helpers import (
    CALLS,
    add_one,
    assert_clean,
    capture_simple,
    check_simple,
    double_into,
    reset_calls,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg
from bcg.capture_rules import is_emulated_capturing

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
    assert_clean(g)


# ----------------------------------------------------------------------------------------------------------------
# recapture


def test_capturing_into_a_captured_graph_requires_reset():
    g = bcg.BreakableCUDAGraph(emulate=True)
    x = torch.zeros(3)
    out = capture_simple(g, x)
    with pytest.raises(bcg.CaptureError, match="reset"):
        with bcg.breakable_graph(g):
            x * 5
    assert not bcg.is_capturing()
    check_simple(g, x, out)  # the first capture is untouched


def test_reset_and_recapture():
    g = bcg.BreakableCUDAGraph(emulate=True)
    pool = g.pool()
    x = torch.zeros(3)
    capture_simple(g, x)
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
