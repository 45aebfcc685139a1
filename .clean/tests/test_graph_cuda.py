"""The core BreakableCUDAGraph suite on real CUDA graphs (emulate=False): breaks and boundary buffers, segments, a
failing replay.

On a GPU, capture does not execute kernels, so eager functions see garbage at capture time; these tests only
check values after replay. Each test is small and fast. Capture and its failures, and shared pools, have their own
files (test_capture_cuda, test_graph_pools_cuda).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from cuda_graph_helpers import (
    DEV,
    add_one,
    capture_simple,
    check_simple,
    cuda_graph,
    double_into,
    flaky_island,
    no_stream_left_capturing,  # noqa: F401 - an autouse fixture: imported, it runs for every test here
)

import bcg
from bcg.graph import EagerStep

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@bcg.eager_on_graph
def pair(x: torch.Tensor) -> dict:
    return {"a": x + 1, "b": (x * 2, 3)}


# ----------------------------------------------------------------------------------------------------------------
# breaks and boundary buffers


@pytest.mark.parametrize("n_breaks", [0, 1, 8])
def test_breaks_replay_new_inputs(n_breaks):
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

    x, buf = torch.randn(64, device=DEV), torch.empty(64, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        out = step(x, buf)
    assert (g.num_segments, g.num_breaks) == (n_breaks + 1, n_breaks)
    for _ in range(3):
        x.copy_(torch.randn(64, device=DEV))
        g.replay()
        torch.testing.assert_close(out, step(x.clone(), torch.empty_like(buf)))


def test_structured_boundary_buffers_are_refreshed_in_place():
    x = torch.zeros(16, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        r = pair(x * 1)
        out = r["a"] + r["b"][0] * r["b"][1]
    buffers = next(s for s in g.steps if isinstance(s, EagerStep)).boundary.buffers
    ptrs = [b.data_ptr() for b in buffers]
    for v in (1.0, 4.0):
        x.fill_(v)
        g.replay()
        assert [b.data_ptr() for b in buffers] == ptrs
        torch.testing.assert_close(out, torch.full((16,), (v + 1) + 6 * v, device=DEV))


def test_zero_copy_eager_function_writes_into_its_argument():
    x, out = torch.zeros(16, device=DEV), torch.zeros(16, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        double_into(x + 1, out)
        y = out * 3
    assert next(s for s in g.steps if isinstance(s, EagerStep)).boundary.buffers == []
    ptr = out.data_ptr()
    x.fill_(2.0)
    g.replay()
    assert out.data_ptr() == ptr
    torch.testing.assert_close(y, torch.full((16,), 18.0, device=DEV))


def test_boundary_mismatch_raises_and_the_graph_recovers():
    state = {"n": 16}

    @bcg.eager_on_graph
    def shifty(x):
        return torch.ones(state["n"], device=DEV) + x.sum()

    x = torch.zeros(16, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        y = shifty(x * 1) * 2
    state["n"] = 8
    with pytest.raises(bcg.BoundaryMismatchError, match=r"shifty(.|\n)*shape=\[16\](.|\n)*shape=\[8\]"):
        g.replay()
    state["n"] = 16
    x.fill_(1.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((16,), 34.0, device=DEV))


def test_eager_function_with_host_reads_and_data_dependent_shapes():
    @bcg.eager_on_graph
    def positive_positions(x, out):
        idx = x.nonzero().flatten()
        n = int(idx.numel())  # host sync: legal between segments
        out.fill_(-1)
        out[:n] = idx

    x, out = torch.zeros(8, device=DEV), torch.empty(8, dtype=torch.int64, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        positive_positions(x * 1, out)
        y = out + 0
    x.copy_(torch.tensor([0, 0, 5, 0, 1, 0, 0, 0], dtype=torch.float32, device=DEV))
    g.replay()
    assert y.tolist() == [2, 4, -1, -1, -1, -1, -1, -1]


def test_capture_stub_defines_the_buffer_and_replay_runs_the_real_function():
    calls = []

    @bcg.eager_on_graph(capture_stub=lambda x: torch.empty(2, x.shape[0], device=DEV))
    def gather(x):
        calls.append("real")
        return torch.stack([x, x * 10])

    x = torch.zeros(4, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        y = gather(x + 1) + 1
    assert calls == []
    x.fill_(1.0)
    g.replay()
    assert calls == ["real"]
    torch.testing.assert_close(y, torch.tensor([[3.0] * 4, [21.0] * 4], device=DEV))


def test_inference_mode_capture_and_replay():
    with torch.inference_mode():
        x = torch.zeros(16, device=DEV)
        g = cuda_graph()
        out = capture_simple(g, x)
        x.fill_(2.0)
    g.replay()  # outside inference mode
    torch.testing.assert_close(out, torch.full((16,), 15.0, device=DEV))
    with torch.inference_mode():
        check_simple(g, x, out)


# ----------------------------------------------------------------------------------------------------------------
# segments


def test_torch_warns_on_an_empty_cuda_graph():
    # bcg recognises an empty segment by this warning; if torch drops it, consecutive breaks break.
    s = torch.cuda.Stream()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with pytest.warns(UserWarning, match="The CUDA Graph is empty"):
            cg.capture_begin()
            cg.capture_end()


@pytest.mark.parametrize(
    "pattern, segments, breaks",
    [("KBBK", 2, 2), ("BKB", 1, 2), ("BBB", 0, 3), ("KBBBBKBK", 3, 5)],
)
def test_consecutive_breaks_give_no_empty_segment(pattern, segments, breaks):
    x = torch.zeros(16, device=DEV)
    g = cuda_graph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bcg.breakable_graph(g):
            for c in pattern:
                if c == "K":
                    x.add_(1)
                else:
                    bcg.break_graph()
    assert not [w for w in caught if "empty" in str(w.message)], "the empty-graph warning leaked"
    assert (g.num_segments, g.num_breaks) == (segments, breaks)
    x.zero_()
    g.replay()
    torch.testing.assert_close(x, torch.full((16,), float(pattern.count("K")), device=DEV))


def test_one_device_sync_and_cache_cleanup_per_capture(monkeypatch):
    counts = {"synchronize": 0, "empty_cache": 0}
    real_sync, real_empty = torch.cuda.synchronize, torch.cuda.empty_cache

    def sync(*args, **kwargs):
        counts["synchronize"] += 1
        return real_sync(*args, **kwargs)

    def empty(*args, **kwargs):
        counts["empty_cache"] += 1
        return real_empty(*args, **kwargs)

    x, buf = torch.zeros(16, device=DEV), torch.zeros(16, device=DEV)
    g = cuda_graph()
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty)
    with bcg.breakable_graph(g):
        h = x
        for _ in range(16):
            h = add_one(h * 2)
            double_into(h, buf)
            h = h + buf
    monkeypatch.undo()
    assert g.num_breaks == 32
    assert counts == {"synchronize": 1, "empty_cache": 1}


# ----------------------------------------------------------------------------------------------------------------
# a failing replay


def test_exception_during_replay_then_a_correct_replay():
    fail, flaky = flaky_island()
    x = torch.zeros(16, device=DEV)
    g = cuda_graph()
    with bcg.breakable_graph(g):
        y = flaky(x * 2) * 3
    fail["on"] = True
    with pytest.raises(RuntimeError, match="replay boom"):
        g.replay()
    fail["on"] = False
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((16,), 15.0, device=DEV))
