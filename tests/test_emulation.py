"""The CPU emulation behaves like a CUDA graph: tensors are addresses, Python values are baked, and whatever a
CUDA graph cannot capture (host reads, data-dependent shapes) raises UncapturableOpError during capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import bcg
from bcg.capture_rules import UncapturableOpError, is_emulated_capturing
from bcg.emulation import EmulatedGraph


def _uncapturable_ops():
    """(id, op) pairs; each op is illegal in a CUDA graph capture and fine anywhere else."""
    return [
        ("item", lambda t: t.sum().item()),
        ("int", lambda t: int(t.sum())),
        ("float", lambda t: float(t.sum())),
        ("bool", lambda t: bool(t.sum())),
        ("if", lambda t: 1 if t.sum() else 0),
        ("tolist", lambda t: t.tolist()),
        ("cpu", lambda t: t.cpu()),
        ("numpy", lambda t: t.numpy()),
        ("np.asarray", lambda t: np.asarray(t)),
        ("print", lambda t: print(t)),
        ("repr", lambda t: repr(t)),
        ("str", lambda t: str(t)),
        ("format", lambda t: f"{t}"),
        ("nonzero", lambda t: t.nonzero()),
        ("where-1-arg", lambda t: torch.where(t > 0)),
        ("bool-mask-index", lambda t: t[t > 0]),
        ("bool-mask-index-put", lambda t: t.__setitem__(t > 0, 0.0)),
        ("masked_select", lambda t: torch.masked_select(t, t > 0)),
        ("unique", lambda t: torch.unique(t)),
        ("unique-dim", lambda t: torch.unique(t.view(2, 2), dim=0)),
        ("unique_consecutive", lambda t: torch.unique_consecutive(t)),
        ("bincount", lambda t: torch.bincount(t.long())),
        ("equal", lambda t: torch.equal(t, t)),
        ("allclose", lambda t: torch.allclose(t, t)),
        ("torch.tensor", lambda t: torch.tensor([1.0, 2.0])),
        ("one_hot-no-classes", lambda t: torch.nn.functional.one_hot(t.long())),
        ("repeat_interleave", lambda t: torch.repeat_interleave(t, t.long())),
    ]


UNCAPTURABLE = [pytest.param(op, id=name) for name, op in _uncapturable_ops()]


@pytest.fixture(autouse=True)
def _no_debris():
    yield
    assert not bcg.is_capturing() and not is_emulated_capturing()
    assert _get_current_dispatch_mode() is None


def _input():
    return torch.tensor([1.0, 0.0, 2.0, 1.0])


# ----------------------------------------------------------------------------------------------------------------
# EmulatedGraph on its own


def test_replay_reads_the_current_contents_of_inputs():
    x = torch.zeros(4)
    g = EmulatedGraph()
    g.capture_begin()
    y = torch.exp(x) * 2 + 1
    z = y.view(2, 2).t().contiguous()  # view of a fresh tensor, then a copy
    g.capture_end()
    x.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    g.replay()
    torch.testing.assert_close(y, torch.exp(x) * 2 + 1)
    torch.testing.assert_close(z, (torch.exp(x) * 2 + 1).view(2, 2).t())


def test_outputs_keep_their_addresses_across_replays():
    x = torch.zeros(8)
    g = EmulatedGraph()
    g.capture_begin()
    y = x + 1
    g.capture_end()
    ptr = y.data_ptr()
    for v in range(3):
        x.fill_(float(v))
        g.replay()
        assert y.data_ptr() == ptr
        torch.testing.assert_close(y, torch.full((8,), v + 1.0))


def test_in_place_ops_are_replayed_in_order():
    x = torch.ones(3)
    acc = torch.zeros(3)
    g = EmulatedGraph()
    g.capture_begin()
    acc.add_(x)
    acc.mul_(3)
    torch.add(acc, x, out=acc)
    g.capture_end()
    acc.zero_()
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(acc, torch.full((3,), 8.0))


def test_python_values_stay_baked():
    x = torch.ones(4)
    scale, flag = 3.0, True
    g = EmulatedGraph()
    g.capture_begin()
    n = x.shape[0]  # metadata is fine and is baked
    y = x * scale + n if flag else x - 100
    g.capture_end()
    scale, flag = 10.0, False  # no effect on the captured graph
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((4,), 2.0 * 3.0 + 4))


def test_empty_capture_records_no_ops():
    x = torch.ones(4)
    g = EmulatedGraph()
    g.capture_begin()
    x.view(2, 2).t()
    torch.empty(3)
    g.capture_end()
    assert g.num_ops == 0


def test_lifecycle_errors():
    g = EmulatedGraph()
    with pytest.raises(RuntimeError, match="before the graph was captured"):
        g.replay()
    with pytest.raises(RuntimeError, match="without capture_begin"):
        g.capture_end()
    g.capture_begin()
    g.capture_end()
    with pytest.raises(RuntimeError, match="already captured"):
        g.capture_begin()
    g.reset()
    g.capture_begin()
    g.capture_end()


def test_capture_flag_follows_the_capture():
    g = EmulatedGraph()
    assert not is_emulated_capturing()
    g.capture_begin()
    assert is_emulated_capturing()
    g.capture_end()
    assert not is_emulated_capturing()


def test_inference_mode_capture_replays_in_inference_mode():
    with torch.inference_mode():
        x = torch.zeros(3)
        g = EmulatedGraph()
        g.capture_begin()
        y = x + 1
        y.mul_(2)
        g.capture_end()
        x.fill_(4.0)
    g.replay()  # called outside inference mode: still writes the inference tensors
    torch.testing.assert_close(y, torch.full((3,), 10.0))


# ----------------------------------------------------------------------------------------------------------------
# uncapturable operations


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_uncapturable_op_raises_in_an_emulated_capture(op, inference):
    # Inference mode (how the runner captures) routes some host reads to other ops: bool(t) -> is_nonzero,
    # torch.where(cond) -> where.default, int(t) -> item.
    x = _input()
    g = EmulatedGraph()
    with torch.inference_mode(inference):
        g.capture_begin()
        try:
            with pytest.raises(bcg.UncapturableOpError, match="cannot be captured in a CUDA graph"):
                op(x)
        finally:
            with pytest.raises(bcg.UncapturableOpError, match="invalidated"):
                g.capture_end()


@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_uncapturable_op_fails_a_breakable_capture_cleanly(op):
    x = _input()
    g = bcg.BreakableCUDAGraph(emulate=True)
    with pytest.raises(bcg.UncapturableOpError):
        with bcg.breakable_graph(g):
            bcg.break_graph()
            op(x * 1)
    assert not g.is_captured


@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_the_same_op_is_fine_inside_an_eager_function(op):
    @bcg.eager_on_graph
    def host_side(x, out):
        op(x.clone())
        out.fill_(int(x.sum()))  # a host read, legal here

    x, out = _input(), torch.zeros(2)
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        host_side(x, out)  # a graph input: its values at capture are real (a segment's output would be garbage)
        y = out * 2
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((2,), 24.0))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_the_same_op_is_fine_outside_a_capture(op):
    expected, x = op(_input()), _input()  # before any capture
    g = EmulatedGraph()
    g.capture_begin()
    with pytest.raises(UncapturableOpError):
        op(x)  # refused while capturing
    with pytest.raises(UncapturableOpError, match="invalidated"):
        g.capture_end()  # as on CUDA, the capture it broke cannot be ended as if nothing happened
    assert _same(op(_input()), expected)  # guards are gone once the capture ended: the same result as before


def test_eager_functions_may_return_data_dependent_shapes_padded():
    @bcg.eager_on_graph
    def positive_positions(x, out):
        idx = x.nonzero().flatten()  # data-dependent: fine eagerly
        out.fill_(-1)
        out[: idx.numel()] = idx

    x, out = _input(), torch.empty(4, dtype=torch.int64)
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        positive_positions(x * 1, out)
        y = out + 0
    x.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    g.replay()
    assert torch.equal(y, torch.tensor([2, -1, -1, -1]))


def test_capturable_cousins_are_allowed():
    # fixed-shape versions of the ops above capture fine
    x = torch.tensor([1.0, -2.0, 3.0, 0.0])
    g = EmulatedGraph()
    g.capture_begin()
    a = torch.where(x > 0, x, torch.zeros_like(x))
    b = x.masked_fill(x < 0, 0.0)
    c = torch.zeros(4, 2, dtype=torch.int64).scatter_(1, (x > 0).long().unsqueeze(1), 1)  # one-hot, fixed shape
    vals, ids = x.topk(2)
    d = x[torch.arange(2)]  # integer indexing has a fixed shape
    e = torch.repeat_interleave(x, torch.full((4,), 2), output_size=8)
    g.capture_end()
    x.copy_(torch.tensor([-1.0, 2.0, 0.0, 4.0]))
    g.replay()
    torch.testing.assert_close(a, torch.tensor([0.0, 2.0, 0.0, 4.0]))
    torch.testing.assert_close(b, torch.tensor([0.0, 2.0, 0.0, 4.0]))
    assert torch.equal(c, torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]]))
    torch.testing.assert_close(d, torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(vals, torch.tensor([4.0, 2.0]))
    assert torch.equal(ids, torch.tensor([3, 1]))
    torch.testing.assert_close(e, x.repeat_interleave(2))


# ----------------------------------------------------------------------------------------------------------------
# collectives: recorded at capture as NCCL records them, issued over gloo at every replay (two rank processes)


def _collectives_on_rank() -> dict:
    import torch.distributed as dist

    from bcg.ops.parallel import init_tensor_parallel

    tp = init_tensor_parallel(2, torch.device("cpu"))
    rank, group_name = tp.rank, dist.group.WORLD.group_name
    x = torch.zeros(4)
    g = EmulatedGraph()
    g.capture_begin()
    summed = x * 2 + 1
    dist.all_reduce(summed)  # c10d::allreduce_, in place
    after = summed * 10  # reads the reduced value at replay
    fresh = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x + 1, "sum", group_name))
    gathered = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(x, 2, group_name))
    g.capture_end()
    at_capture = after.tolist()  # not reduced: the collective was not issued at capture (garbage on CUDA)
    replays = []
    for value in (1.0, 2.0):
        x.fill_(value + rank)
        g.replay()
        replays.append((after.tolist(), fresh.tolist(), gathered.tolist()))
    refused = {}
    for name, fn in (("barrier", dist.barrier), ("monitored_barrier", dist.monitored_barrier),
                     ("all_gather_object", lambda: dist.all_gather_object([None, None], {"rank": rank}))):
        g = EmulatedGraph()
        g.capture_begin()
        try:
            fn()
            refused[name] = None
        except UncapturableOpError as e:
            refused[name] = str(e)
        with pytest.raises(UncapturableOpError):  # the capture stays invalid, as a CUDA capture would
            g.capture_end()
        dist.barrier()  # outside the capture: the ranks realign
    return {"at_capture": at_capture, "replays": replays, "refused": refused}


def test_collectives_are_recorded_at_capture_and_replayed_as_real_collectives():
    from rank_pool import RankPool

    pool = RankPool(2, timeout_s=60)
    try:
        results = pool.run(_collectives_on_rank)
    finally:
        pool.close()
    for res in results:
        assert res["at_capture"] == [10.0] * 4  # 0 * 2 + 1 on this rank only, times 10
        (after1, fresh1, gathered1), (after2, fresh2, gathered2) = res["replays"]
        assert after1 == [(3.0 + 5.0) * 10] * 4 and after2 == [(5.0 + 7.0) * 10] * 4  # x = 1, 2 then 2, 3
        assert fresh1 == [5.0] * 4 and fresh2 == [7.0] * 4
        assert gathered1 == [1.0] * 4 + [2.0] * 4 and gathered2 == [2.0] * 4 + [3.0] * 4
        assert all(reason is not None for reason in res["refused"].values()), res["refused"]
        assert "barrier" in res["refused"]["barrier"] and "barrier" in res["refused"]["monitored_barrier"]


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
def test_repeat_interleave_with_int_repeats_captures(inference):
    # Regression: under inference mode the int-repeats overload reaches the dispatcher undecomposed
    # (aten.repeat_interleave.self_int); it is an expand and a copy, so a CUDA graph captures it.
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    g = EmulatedGraph()
    with torch.inference_mode(inference):
        g.capture_begin()
        y = x.repeat_interleave(3, dim=0)
        g.capture_end()
        x.copy_(torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
        g.replay()
    torch.testing.assert_close(y, torch.tensor([[5.0, 6.0]] * 3 + [[7.0, 8.0]] * 3))


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("call", [lambda x, r: torch.repeat_interleave(r), lambda x, r: x.repeat_interleave(r, dim=0)],
                         ids=["repeats-only", "self-and-repeats"])
def test_repeat_interleave_with_tensor_repeats_is_still_refused(inference, call):
    x, repeats = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 0, 2])
    g = EmulatedGraph()
    with torch.inference_mode(inference):
        g.capture_begin()
        with pytest.raises(bcg.UncapturableOpError, match="repeat_interleave with tensor repeats"):
            call(x, repeats)
        with pytest.raises(bcg.UncapturableOpError, match="invalidated"):
            g.capture_end()


def test_an_island_at_capture_sees_what_a_segment_allocated_as_garbage():
    """On CUDA a segment's kernels only record at capture, so the island called next reads memory nothing wrote. The
    emulation shows it that (NaN, the largest integer) and gives the values back afterwards; graph inputs and
    tensors that existed before the capture keep their values."""
    seen = {}

    @bcg.eager_on_graph
    def island(h, idx, static):
        seen.update(h=h.clone(), idx=idx.clone(), static=static.clone())
        return h + static

    static = torch.arange(4.0)
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        h = static * 2
        idx = torch.argmax(h).reshape(1)
        out = island(h, idx, static) + 1
    assert seen["h"].isnan().all() and seen["idx"].item() == torch.iinfo(torch.int64).max
    assert torch.equal(seen["static"], torch.arange(4.0))
    assert torch.equal(h, static * 2) and idx.item() == 3  # back for the rest of the emulated capture
    static.fill_(1.0)
    g.replay()
    assert torch.equal(out, torch.full((4,), 4.0))


def test_an_island_that_indexes_with_garbage_fails_at_capture_and_a_stub_fixes_it():
    """one_hot over garbage expert ids is a device-side assert on CUDA (the process's CUDA context is lost); the
    emulation fails the same capture, and a capture_stub that runs on zeros passes it."""
    def experts(idx):
        return torch.nn.functional.one_hot(idx, num_classes=4).float().sum(0)

    for stub, fails in ((None, True), (lambda idx: experts(torch.zeros_like(idx)), False)):
        island = bcg.eager_on_graph(experts, capture_stub=stub)
        x = torch.tensor([0.0, 3.0, 1.0])
        g = bcg.BreakableCUDAGraph(emulate=True)
        if fails:
            with pytest.raises(RuntimeError, match="num_classes"), bcg.breakable_graph(g):
                island(torch.argmax(x).reshape(1))
            continue
        with bcg.breakable_graph(g):
            out = island(torch.argmax(x).reshape(1)) * 1
        g.replay()
        assert torch.equal(out, torch.tensor([0.0, 1.0, 0.0, 0.0]))
