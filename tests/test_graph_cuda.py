"""The core BreakableCUDAGraph suite on real CUDA graphs (emulate=False).

On a GPU, capture does not execute kernels, so eager functions see garbage at capture time; these tests only
check values after replay. Each test is small and fast.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import bcg
from bcg import capture as bcg_capture
from bcg.graph import EagerStep

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"


@pytest.fixture(autouse=True)
def _no_stream_left_capturing():
    yield
    assert not bcg.is_capturing()
    assert not torch.cuda.is_current_stream_capturing()
    for s in bcg_capture._default_streams.values():
        with torch.cuda.stream(s):
            assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()


@bcg.eager_on_graph
def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@bcg.eager_on_graph
def double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, 2, out=out)


@bcg.eager_on_graph
def pair(x: torch.Tensor) -> dict:
    return {"a": x + 1, "b": (x * 2, 3)}


def _graph() -> bcg.BreakableCUDAGraph:
    g = bcg.BreakableCUDAGraph(emulate=False)
    assert not g.is_emulated and g.device_type == "cuda"
    return g


def _simple(g: bcg.BreakableCUDAGraph, x: torch.Tensor) -> torch.Tensor:
    with bcg.breakable_graph(g):
        out = add_one(x * 2) * 3
    return out


def _check_simple(g: bcg.BreakableCUDAGraph, x: torch.Tensor, out: torch.Tensor) -> None:
    for v in (1.0, -2.5, 7.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, (x * 2 + 1) * 3)


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
    g = _graph()
    with bcg.breakable_graph(g):
        out = step(x, buf)
    assert (g.num_segments, g.num_breaks) == (n_breaks + 1, n_breaks)
    for _ in range(3):
        x.copy_(torch.randn(64, device=DEV))
        g.replay()
        torch.testing.assert_close(out, step(x.clone(), torch.empty_like(buf)))


def test_structured_boundary_buffers_are_refreshed_in_place():
    x = torch.zeros(16, device=DEV)
    g = _graph()
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
    g = _graph()
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
    g = _graph()
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
    g = _graph()
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
    g = _graph()
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
        g = _graph()
        out = _simple(g, x)
        x.fill_(2.0)
    g.replay()  # outside inference mode
    torch.testing.assert_close(out, torch.full((16,), 15.0, device=DEV))
    with torch.inference_mode():
        _check_simple(g, x, out)


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
    g = _graph()
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
    g = _graph()
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
# shared pools


@bcg.eager_on_graph
def _churn_eager(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 0.5


@bcg.eager_on_graph
def _churn_inplace(t: torch.Tensor) -> None:
    t.mul_(1.25).add_(0.1)


def _churn_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # intermediates are freed when they go out of scope, so the pool reuses their blocks
    big = torch.empty(x.shape[0], 4096, device=x.device).fill_(0.5)
    h = _churn_eager(h + big[:, : h.shape[1]])
    del big
    t = (h * 2).relu()
    _churn_inplace(t)
    bcg.break_graph()
    scratch = torch.empty_like(t).fill_(0.25)  # more freed blocks, filled at replay
    return t.sum(-1, keepdim=True) + x[:, :1] + scratch[:, :1]


def test_graphs_sharing_a_pool_never_read_each_others_memory():
    gen = torch.Generator(device=DEV).manual_seed(0)
    w = torch.randn(64, 128, device=DEV, generator=gen)
    xa = torch.randn(512, 64, device=DEV, generator=gen)
    xb = torch.randn(16, 64, device=DEV, generator=gen)
    _churn_model(xa, w)  # warm up (cuBLAS handles) outside any capture
    torch.cuda.synchronize()
    ga = _graph()
    gb = bcg.BreakableCUDAGraph(pool=ga.pool(), emulate=False)
    with bcg.breakable_graph(ga):
        ya = _churn_model(xa, w)
    with bcg.breakable_graph(gb, pool=ga.pool()):
        yb = _churn_model(xb, w)
    assert gb.pool() == ga.pool()
    order = "ABBAABABBBAAAB" * 3
    for name in order:
        x, g, y = (xa, ga, ya) if name == "A" else (xb, gb, yb)
        x.copy_(torch.randn(x.shape, device=DEV, generator=gen))
        g.replay()
        torch.testing.assert_close(y, _churn_model(x.clone(), w), rtol=1e-4, atol=1e-4)
    # each graph's last result survives the other's replay
    xa.copy_(torch.randn(xa.shape, device=DEV, generator=gen))
    ga.replay()
    expected_a = _churn_model(xa.clone(), w)
    gb.replay()
    torch.testing.assert_close(ya, expected_a, rtol=1e-4, atol=1e-4)


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


def _assert_nothing_capturing(*extra_streams):
    assert not torch.cuda.is_current_stream_capturing()
    for s in (*bcg_capture._default_streams.values(), *extra_streams):
        with torch.cuda.stream(s):
            assert not torch.cuda.is_current_stream_capturing()


def test_unjoined_side_stream_at_a_break_is_a_clear_error():
    x = torch.ones(16, device=DEV)
    side = torch.cuda.Stream()
    g = _graph()
    with pytest.raises(bcg.CaptureError, match=r"not joined(.|\n)*wait_stream(.|\n)*auto_join_streams=True"):
        _side_stream_capture(g, x, side)
    _assert_nothing_capturing(side)
    assert not g.is_captured
    out = _simple(g, x)  # a fresh capture works
    _check_simple(g, x, out)


def test_auto_join_streams_joins_and_gives_correct_results():
    x = torch.ones(16, device=DEV)
    side = torch.cuda.Stream()
    g = _graph()
    out = _side_stream_capture(g, x, side, auto_join_streams=True)
    _assert_nothing_capturing(side)
    for v in (1.0, 5.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, (x * 2 + 1 + 1) * 3)


def test_joined_side_stream_is_fine():
    x = torch.ones(16, device=DEV)
    side = torch.cuda.Stream()
    g = _graph()
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
    g = _graph()
    with pytest.raises(RuntimeError) as info:
        with bcg.breakable_graph(g):
            h = add_one(x * 2)
            h.sum().item()
    assert any("bcg" in note for note in getattr(info.value, "__notes__", []))
    _assert_nothing_capturing()
    assert not g.is_captured
    out = _simple(g, x)
    _check_simple(g, x, out)


def test_exception_in_an_eager_function_resets_and_a_fresh_capture_works():
    @bcg.eager_on_graph
    def broken(x):
        raise KeyError("eager boom")

    x = torch.ones(16, device=DEV)
    g = _graph()
    with pytest.raises(KeyError, match="eager boom"):
        with bcg.breakable_graph(g):
            broken(x * 2)
    _assert_nothing_capturing()
    assert not g.is_captured
    out = _simple(g, x)
    _check_simple(g, x, out)


def test_exception_during_replay_then_a_correct_replay():
    fail = {"on": False}

    @bcg.eager_on_graph
    def flaky(x):
        if fail["on"]:
            raise RuntimeError("replay boom")
        return x + 1

    x = torch.zeros(16, device=DEV)
    g = _graph()
    with bcg.breakable_graph(g):
        y = flaky(x * 2) * 3
    fail["on"] = True
    with pytest.raises(RuntimeError, match="replay boom"):
        g.replay()
    fail["on"] = False
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((16,), 15.0, device=DEV))


def test_nested_capture_raises():
    x = torch.ones(16, device=DEV)
    outer, inner = _graph(), _graph()
    with pytest.raises(bcg.CaptureError, match="nested"):
        with bcg.breakable_graph(outer):
            x * 2
            with bcg.breakable_graph(inner):
                x * 3
    _assert_nothing_capturing()
    out = _simple(inner, x)
    _check_simple(inner, x, out)


def test_pool_survives_reset_dropped_segments_and_deleted_sharers():
    # torch retires a pool when its last CUDAGraph dies; a later capture into the same handle then fails an
    # internal assert. bcg keeps the pool alive for as long as any BreakableCUDAGraph using it lives.
    x = torch.zeros(16, device=DEV)
    a = _graph()
    with bcg.breakable_graph(a):
        bcg.break_graph()  # the first segment is empty and dropped
        y = x + 1
    b = bcg.BreakableCUDAGraph(pool=a.pool(), emulate=False)
    out_b = _simple(b, x)
    del a, y
    b.reset()
    out_b = _simple(b, x)
    _check_simple(b, x, out_b)


def test_failed_capture_moves_an_owned_graph_to_a_fresh_pool():
    # An invalidated capture leaves its pool "already recording" in torch, so the graph takes a new pool.
    x = torch.ones(16, device=DEV)
    g = _graph()
    old = g.pool()
    with pytest.raises(RuntimeError):
        with bcg.breakable_graph(g):
            (x * 2).sum().item()
    assert g.pool() != old
    out = _simple(g, x)
    _check_simple(g, x, out)


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
                g = _graph()
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
    g = _graph()
    _simple(g, x)
    g.reset()
    with bcg.breakable_graph(g):
        y = add_one(x - 1) * 7
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((16,), 21.0, device=DEV))
