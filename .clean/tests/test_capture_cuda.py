"""breakable_graph, the capture, on real CUDA graphs (emulate=False): side streams at a break, every failure leaving
no stream capturing, nesting, two threads capturing at once, reset and recapture."""

from __future__ import annotations

import threading

import pytest
import torch
from cuda_graph_helpers import (
    DEV,
    add_one,
    assert_nothing_capturing,
    broken,
    capture_simple,
    check_simple,
    cuda_graph,
    no_stream_left_capturing,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# ----------------------------------------------------------------------------------------------------------------
# streams


def _side_stream_capture(g, x, side, **kwargs):
    with bcg.breakable_graph(g, **kwargs):
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())  # fork
        with torch.cuda.stream(side):
            z = y + 1
        w = add_one(z)  # a break while side is still forked (unless auto-joined)
        out = w * 3
    return out


def test_unjoined_side_stream_at_a_break_is_a_clear_error():
    x = torch.ones(16, device=DEV)
    side = torch.cuda.Stream()
    g = cuda_graph()
    with pytest.raises(bcg.CaptureError, match=r"not joined(.|\n)*wait_stream(.|\n)*auto_join_streams=True"):
        _side_stream_capture(g, x, side)
    assert_nothing_capturing(side)
    assert not g.is_captured
    out = capture_simple(g, x)  # a fresh capture works
    check_simple(g, x, out)


def test_auto_join_streams_joins_and_gives_correct_results():
    x = torch.ones(16, device=DEV)
    side = torch.cuda.Stream()
    g = cuda_graph()
    out = _side_stream_capture(g, x, side, auto_join_streams=True)
    assert_nothing_capturing(side)
    for v in (1.0, 5.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, (x * 2 + 1 + 1) * 3)


def test_joined_side_stream_is_fine():
    x = torch.ones(16, device=DEV)
    side = torch.cuda.Stream()
    g = cuda_graph()
    with bcg.breakable_graph(g):
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            z = y + 1
        torch.cuda.current_stream().wait_stream(side)  # join
        out = add_one(z) * 3
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(out, torch.full((16,), 18.0, device=DEV))


# ----------------------------------------------------------------------------------------------------------------
# errors leave no debris


def test_item_in_a_segment_raises_and_leaves_no_stream_capturing():
    x = torch.ones(16, device=DEV)
    g = cuda_graph()
    with pytest.raises(RuntimeError) as info:
        with bcg.breakable_graph(g):
            h = add_one(x * 2)
            h.sum().item()
    assert any("bcg" in note for note in getattr(info.value, "__notes__", []))
    assert_nothing_capturing()
    assert not g.is_captured
    out = capture_simple(g, x)
    check_simple(g, x, out)


def test_exception_in_an_eager_function_resets_and_a_fresh_capture_works():
    x = torch.ones(16, device=DEV)
    g = cuda_graph()
    with pytest.raises(KeyError, match="eager boom"):
        with bcg.breakable_graph(g):
            broken(x * 2)
    assert_nothing_capturing()
    assert not g.is_captured
    out = capture_simple(g, x)
    check_simple(g, x, out)


def test_nested_capture_raises():
    x = torch.ones(16, device=DEV)
    outer, inner = cuda_graph(), cuda_graph()
    with pytest.raises(bcg.CaptureError, match="nested"):
        with bcg.breakable_graph(outer):
            x * 2
            with bcg.breakable_graph(inner):
                x * 3
    assert_nothing_capturing()
    out = capture_simple(inner, x)
    check_simple(inner, x, out)


# ----------------------------------------------------------------------------------------------------------------
# threads, reset and recapture


def test_two_threads_capture_and_replay_concurrently():
    # CUDA captures are serialised by a process-wide lock (a device sync while another thread's stream captures is
    # not permitted). One thread may replay while the other captures, provided it stays off the legacy default
    # stream (which would join the capturing stream) and the capture uses "thread_local" error mode (so the other
    # thread's syncs do not invalidate it). A first version of this test replayed on the default stream and CUDA
    # invalidated the concurrent capture, as documented.
    start = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []
    in_capture = []

    def worker(i: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(DEV)):
                x = torch.full((16,), float(i), device=DEV)
                g = cuda_graph()
                start.wait()
                with bcg.breakable_graph(g, capture_error_mode="thread_local"):
                    in_capture.append(i)
                    assert len(in_capture) == 1, "two captures overlapped"
                    h = add_one(x * 2 + i) * 3
                    in_capture.remove(i)
                for k in range(50):
                    x.fill_(float(k + 10 * i))
                    g.replay()
                    torch.testing.assert_close(h, (x * 2 + i + 1) * 3)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_reset_and_recapture():
    x = torch.zeros(16, device=DEV)
    g = cuda_graph()
    capture_simple(g, x)
    g.reset()
    with bcg.breakable_graph(g):
        y = add_one(x - 1) * 7
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((16,), 21.0, device=DEV))
