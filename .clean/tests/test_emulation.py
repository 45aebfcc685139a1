"""The CPU emulation behaves like a CUDA graph: tensors are addresses, Python values are baked, collectives are
recorded at capture and issued at replay, and an island at capture sees what a segment allocated as garbage.

What a CUDA graph cannot capture (host reads, data-dependent shapes) has its own file (test_capture_rules).
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import no_debris  # noqa: F401 - an autouse fixture: imported, it runs for every test here

import bcg
from bcg.capture_rules import UncapturableOpError, is_emulated_capturing
from bcg.emulation import EmulatedGraph

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


# ----------------------------------------------------------------------------------------------------------------
# islands at capture


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
