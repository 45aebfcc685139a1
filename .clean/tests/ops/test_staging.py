"""The metadata staging path: layouts at fixed arena offsets, the host ring that batches are staged in, one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bcg.ops.staging import Field, HostRing, Layout, MetadataArena, Staged


def _fill(staged: Staged, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random values in every field of ``staged``; returns what was written."""
    wrote = {}
    for name, view in staged.host.items():
        wrote[name] = rng.integers(-1000, 1000, size=view.size).astype(view.dtype)
        view[:] = wrote[name]
    return wrote


def _check(views: dict[str, torch.Tensor], wrote: dict[str, np.ndarray]) -> None:
    assert set(views) == set(wrote)
    for name, values in wrote.items():
        assert views[name].cpu().numpy().tolist() == values.tolist(), name


def _arena(device: torch.device) -> tuple[MetadataArena, list[Layout]]:
    arena = MetadataArena(device, capacity=1 << 15)
    tail = (Field("cu", 0, "int32"), Field("keys", 0))
    layouts = [arena.layout([Field("ids", n), Field("cu_fixed", 2 * n + 3, "int32"), Field("rows", 3)], tail)
               for n in (4, 16, 64)]
    return arena, layouts


def test_ring_hands_buffers_in_turn_and_grows_one_only_when_a_batch_needs_it() -> None:
    ring = HostRing(torch.device("cpu"), size=3)
    order = [ring.take(16) for _ in range(7)]
    assert order == [0, 1, 2, 0, 1, 2, 0]
    small = ring.buffer(1)
    assert small.numel() == HostRing.MIN_WORDS
    ring.take(16)  # buffer 1 again: big enough, kept
    assert ring.buffer(1) is small
    ring.take(16)
    ring.take(3 * HostRing.MIN_WORDS)  # buffer 0 must grow
    assert ring.buffer(0).numel() >= 3 * HostRing.MIN_WORDS and ring.buffer(1) is small


def test_a_ring_buffer_keeps_each_layouts_views_and_drops_them_when_it_grows() -> None:
    ring = HostRing(torch.device("cpu"), size=1)
    layout = Layout([Field("a", 5), Field("b", 3, "int32")])
    ring.take(layout.num_words)
    words, views = ring.views(0, layout)
    assert ring.views(0, layout)[1] is views and words.numel() == layout.num_words
    ring.take(4 * HostRing.MIN_WORDS)
    words, fresh = ring.views(0, layout)
    assert fresh is not views  # the old views point into the buffer that was replaced
    assert np.shares_memory(fresh["a"], ring.array(0)) and words.data_ptr() == ring.buffer(0).data_ptr()


@pytest.mark.parametrize("ring_size", [1, 2, 4])
def test_batches_staged_through_the_ring_arrive_whole_whatever_came_before(ring_size: int) -> None:
    # Every field is rewritten per batch: a batch after a larger one, in another layout, with other tail sizes,
    # reads only its own values (what a captured graph would read at the layout's fixed views).
    arena, layouts = _arena(torch.device("cpu"))
    arena.ring = HostRing(torch.device("cpu"), size=ring_size)
    rng = np.random.default_rng(0)
    for step in range(40):
        layout = layouts[rng.integers(len(layouts))]
        tails = {"cu": int(rng.integers(0, 9)), "keys": int(rng.integers(0, 300))}
        staged = arena.stage(layout, **tails)
        assert {f.name: f.length for f in staged.tail_fields} == tails
        wrote = _fill(staged, rng)
        views = staged.upload()
        _check(views, wrote)
        for name in layout.fields:  # the fixed fields sit at the layout's own addresses
            assert views[name].data_ptr() == layout.views[name].data_ptr(), (step, name)


def test_ring_staging_matches_a_fresh_buffer() -> None:
    arena, layouts = _arena(torch.device("cpu"))
    rng = np.random.default_rng(1)
    for layout in layouts * 3:
        tails = {"cu": 5, "keys": int(rng.integers(0, 50))}
        staged = arena.stage(layout, **tails)
        wrote = _fill(staged, rng)
        ring_views = {k: v.clone() for k, v in staged.upload().items()}
        fresh = Staged(layout, tails, torch.device("cpu"))
        for name, values in wrote.items():
            fresh.host[name][:] = values
        fresh_views = fresh.upload()
        for name in wrote:
            assert torch.equal(ring_views[name], fresh_views[name]), name


def test_a_batch_larger_than_the_arena_is_refused_by_name_and_the_next_one_stages() -> None:
    arena = MetadataArena(torch.device("cpu"), capacity=64)
    layout = arena.layout([Field("ids", 8)], (Field("keys", 0),))
    with pytest.raises(ValueError, match="does not fit the arena of 64"):
        arena.stage(layout, keys=100)
    staged = arena.stage(layout, keys=4)
    staged.host["ids"][:] = np.arange(8)
    staged.host["keys"][:] = [9, 8, 7, 6]
    views = staged.upload()
    assert views["ids"].tolist() == list(range(8)) and views["keys"].tolist() == [9, 8, 7, 6]


def test_empty_tails_have_empty_views_on_both_sides() -> None:
    arena, layouts = _arena(torch.device("cpu"))
    staged = arena.stage(layouts[0], cu=0, keys=0)
    assert staged.host["cu"].size == 0 and staged.host["keys"].dtype == np.int64
    views = staged.upload()
    assert views["cu"].numel() == 0 and views["cu"].dtype == torch.int32 and views["keys"].dtype == torch.int64


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_ring_waits_for_queued_copies_before_it_rewrites_a_pinned_buffer() -> None:
    # The GPU is held busy while more batches are staged than the ring has buffers: without the events, a later batch
    # would overwrite a pinned buffer whose copy has not run yet, and an earlier batch's snapshot would read it.
    device = torch.device("cuda")
    arena, layouts = _arena(device)
    arena.ring = HostRing(device, size=2)
    layout = layouts[1]
    rng = np.random.default_rng(2)
    snapshots, expected = [], []
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of queued device work
    for _ in range(6):
        staged = arena.stage(layout, cu=5, keys=7)
        wrote = _fill(staged, rng)
        views = staged.upload()
        snapshots.append({k: v.clone() for k, v in views.items()})  # ordered after this batch's copy
        expected.append(wrote)
    torch.cuda.synchronize()
    for views, wrote in zip(snapshots, expected):
        _check(views, wrote)


def test_tails_of_lengths_seen_before_reuse_their_offsets_views_and_host_views() -> None:
    # A breakable replay's batch has tails (its cumulative lengths); a request count seen before must cut nothing
    # again: the same device views, the same host views of each ring buffer, and still every value arrives.
    arena, layouts = _arena(torch.device("cpu"))
    arena.ring = HostRing(torch.device("cpu"), size=2)
    layout, rng = layouts[1], np.random.default_rng(3)
    device_views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    host_views: dict[tuple[int, int, int], np.ndarray] = {}
    reused = 0
    for step in range(12):
        tails = {"cu": 7 if step % 3 else 10, "keys": 0 if step % 2 else 5}
        staged = arena.stage(layout, **tails)
        wrote = _fill(staged, rng)
        views = staged.upload()
        _check(views, wrote)
        key = (tails["cu"], tails["keys"])
        before = device_views.setdefault(key, views)
        assert all(views[n] is before[n] for n in views)  # the plan's device views, not new slices
        host = host_views.setdefault((*key, staged._slot), staged.host["cu"])
        reused += host is staged.host["cu"] and before is not views
    assert reused == 12 - len(host_views) and len(host_views) < 12
    assert len(layout._tail_plans) == len(device_views) == 4


def test_tail_plans_and_ring_views_stay_bounded() -> None:
    from bcg.ops import staging

    arena, layouts = _arena(torch.device("cpu"))
    for keys in range(1, 4 * staging._MAX_TAIL_PLANS):
        staged = arena.stage(layouts[0], cu=3, keys=keys)
        staged.host["keys"][:] = np.arange(keys)
        assert staged.upload()["keys"].tolist() == list(range(keys))
    assert len(layouts[0]._tail_plans) <= staging._MAX_TAIL_PLANS
    assert all(len(v) <= 4 * staging._MAX_TAIL_PLANS for v in arena.ring._views)
