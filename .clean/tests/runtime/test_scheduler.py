"""The one planner as a prefill drives it: chunks of first-come-first-served prompts under a token budget, over a
reservation of exactly the slots its forwards hold together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bcg.ops.kv_cache import KVPool
from bcg.runtime.kv_slots import SlotReservation, slots_held
from bcg.runtime.runner.telemetry import BatchRecord
from bcg.runtime.serving.batcher import Batcher
from bcg.runtime.serving.policy import FifoQueue
from bcg.runtime.serving.request import Request

RECORD = BatchRecord(0, 0, None, False, "test")


def run_plan(lengths: list[int], budget: int, pool: KVPool) -> list[list[tuple[int, int, int, np.ndarray]]]:
    """Plans ``lengths`` as ``Engine.prefill`` does (no forwards); per forward, per chunk: (prompt, start, end, the
    batch's new slots of that chunk). Checks each forward against the reservation's accounting on the way."""
    reservation = SlotReservation(pool, lengths, budget)
    reservation.reserve()
    batcher = Batcher(pool, None, budget, FifoQueue(), reservation)
    for seq, n in enumerate(lengths):
        batcher.add(Request(torch.arange(n), None, seq=seq))
    held, forwards, ended = slots_held(lengths, budget).tolist(), [], []
    try:
        while batcher.has_work:
            plan = batcher.plan()
            assert plan is not None
            in_flight = {id(r): r for r in batcher.running}
            assert sum(end for r in in_flight.values() for q, _, end in plan.chunks if q is r) + sum(
                r.done for r in in_flight.values() if all(q is not r for q, _, _ in plan.chunks)) == held[len(forwards)]
            offsets = np.cumsum([0] + [end - start for _, start, end in plan.chunks])
            ending = [i for i, (req, _, end) in enumerate(plan.chunks) if end == len(req.ids)]
            assert [r.seq for r in plan.finishing] == [plan.chunks[i][0].seq for i in ending]
            assert plan.batch.host_logit_rows.tolist() == [offsets[i + 1] - 1 for i in ending]  # their last tokens
            ended += [r.seq for r in plan.finishing]
            forwards.append([(req.seq, start, end, plan.batch.host_write_slots[offsets[i] : offsets[i + 1]])
                             for i, (req, start, end) in enumerate(plan.chunks)])
            batcher.launched(plan, RECORD)
    finally:
        assert reservation.release()
    assert ended == list(range(len(lengths)))  # prompts end in order: prefill's logits need no reordering
    return forwards


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=16), st.integers(1, 64))
def test_plan_covers_every_token_once_in_order_within_budget(lengths: list[int], chunk: int) -> None:
    pool = KVPool(num_slots=sum(lengths) + chunk, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    forwards = run_plan(lengths, chunk, pool)
    covered = [0] * len(lengths)
    for chunks in forwards:
        assert 0 < sum(end - start for _, start, end, _ in chunks) <= chunk
        assert len({r for r, _, _, _ in chunks}) == len(chunks)  # a request at most once per batch
        slots = np.concatenate([s for _, _, _, s in chunks])
        assert np.unique(slots).size == slots.size  # no slot written twice in one forward
        for r, start, end, _ in chunks:
            assert start == covered[r]  # chunks of a request arrive in order, prefix complete
            covered[r] = end
    assert covered == lengths
    assert len(forwards) == -(-sum(lengths) // chunk)  # every forward but the last is full
    assert pool.num_free == pool.num_slots  # the reservation gave everything back


def test_short_prompts_share_one_batch() -> None:
    pool = KVPool(num_slots=32, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    assert len(run_plan([3, 4, 5], 16, pool)) == 1


def test_slots_held_is_what_the_planner_holds_and_finished_prompts_slots_are_reused() -> None:
    assert slots_held([90, 30, 30], 32).tolist() == [32, 64, 96, 38, 30]
    assert slots_held([3, 4, 5], 16).tolist() == [12]
    pool = KVPool(num_slots=96, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    forwards = run_plan([90, 30, 30], 32, pool)  # run_plan checks every forward against slots_held
    first = set(np.concatenate([s for f in forwards[:3] for r, _, _, s in f if r == 0]).tolist())
    later = set(np.concatenate([s for f in forwards[3:] for r, _, _, s in f if r == 2]).tolist())
    assert first & later  # the last prompt runs in slots the long one gave back within the same call


def test_a_reservation_that_ends_part_way_returns_the_lent_slots_too() -> None:
    pool = KVPool(num_slots=100, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    reservation = SlotReservation(pool, [50, 20, 30], 32)
    reservation.reserve()
    assert pool.num_free == 100 - reservation.peak == 36
    lent = reservation.take(32)
    reservation.finished_forward()
    reservation.take(32)
    reservation.give(lent[:18])  # a prompt ended
    reservation.finished_forward()  # later forwards hold at most 46: 18 go back to the pool now
    assert pool.num_free == 36 + 18
    assert reservation.release() and not reservation.release()
    assert pool.num_free == 100
    with pytest.raises(RuntimeError, match="slots_held"):  # a planner that outran its reservation is a bug
        SlotReservation(pool, [4], 4).take(1)
