"""The scheduler's decisions without threads or a model: the token budget, chunking, the two policies, admission
with the prefix cache, and what a launched or failed forward does to the slots (a stand-in forward writes, per slot,
which prefix it holds, and checks that every chunk reads its own prefix)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from bcg.ops.kv_cache import KVPool
from bcg.runtime.runner.telemetry import BatchRecord
from bcg.runtime.serving.batcher import Batcher, Plan
from bcg.runtime.serving.policy import POLICIES, FifoQueue, ShortestFirstQueue, make_queue
from bcg.runtime.serving.prefix_cache import PrefixCache
from bcg.runtime.serving.request import Request

RECORD = BatchRecord(0, 0, None, False, "test")


class World:
    """A pool, its cache, a batcher and what every slot holds."""

    def __init__(self, num_slots: int = 256, budget: int = 16, cache: bool = True, policy: str = "fifo") -> None:
        self.pool = KVPool(num_slots=num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
        self.cache = PrefixCache(self.pool) if cache else None
        self.batcher = Batcher(self.pool, self.cache, budget, make_queue(policy))
        self.content: dict[int, tuple] = {}
        self.seq = 0

    def submit(self, tokens: list[int]) -> Request:
        req = Request(torch.tensor(tokens, dtype=torch.long), Future(), seq=self.seq)
        self.seq += 1
        self.batcher.add(req)
        return req

    def forward(self, plan: Plan) -> None:
        """Checks the batch against its chunks, that every prefix slot holds its token's prefix, then writes."""
        batch = plan.batch
        assert batch.num_tokens <= self.batcher.budget
        assert len({id(r) for r, _, _ in plan.chunks}) == len(plan.chunks)  # a request once per forward
        for (req, start, end), n_q, n_prefix in zip(plan.chunks, batch.seq_lens_q, batch.prefix_lens):
            assert (n_q, n_prefix) == (end - start, start)
            toks = tuple(req.tokens.tolist())
            for j in range(start):
                assert self.content[int(req.slots[j])] == toks[: j + 1], "a chunk read another prefix's KV"
            for j in range(start, end):
                self.content[int(req.slots[j])] = toks[: j + 1]

    def run(self, limit: int = 1000) -> list[Plan]:
        plans = []
        while self.batcher.has_work and len(plans) < limit:
            plan = self.batcher.plan()
            assert plan is not None, "work left but nothing planned"
            self.forward(plan)
            self.batcher.launched(plan, RECORD)
            plans.append(plan)
        return plans

    def whole(self) -> bool:
        if self.cache is not None:
            self.cache.clear()
        return self.pool.num_free == self.pool.num_slots


def test_policies_are_the_configs() -> None:
    from bcg.runtime.config import SCHEDULE_POLICIES

    assert tuple(POLICIES) == SCHEDULE_POLICIES
    assert type(make_queue("shortest")) is ShortestFirstQueue and type(make_queue("fifo")) is FifoQueue


@pytest.mark.parametrize("cache", [True, False])
def test_forwards_stay_under_the_budget_and_chunk_long_prompts(cache: bool) -> None:
    w = World(budget=16, cache=cache)
    reqs = [w.submit(list(range(n))) for n in (5, 40, 3, 16, 1, 9)]  # shared prefixes 0, 1, 2, ...
    plans = w.run()
    assert all(p.batch.num_tokens <= 16 for p in plans)
    assert all(r.done == r.num_tokens and r.slots is None for r in reqs)  # finished, nothing held
    assert sum(p.batch.num_tokens for p in plans) == sum(r.num_tokens - r.cached for r in reqs)
    long = reqs[1]
    assert len(long.batches) >= 3  # 40 tokens through a 16-token budget
    assert w.whole()


def test_running_requests_continue_first_and_fifo_admits_in_arrival_order() -> None:
    w = World(budget=8, cache=False)
    a, b, c = w.submit([1] * 12), w.submit([2] * 3), w.submit([3] * 2)
    first = w.batcher.plan()
    assert [(r, s, e) for r, s, e in first.chunks] == [(a, 0, 8)]
    w.forward(first)
    w.batcher.launched(first, RECORD)
    second = w.batcher.plan()
    assert [(r, s, e) for r, s, e in second.chunks] == [(a, 8, 12), (b, 0, 3), (c, 0, 1)]
    assert second.finishing == [a, b]  # c's first chunk ends nothing: no logits row for it
    assert second.batch.num_logit_rows == 2


def test_shortest_first_admits_the_shortest_waiting_prompt() -> None:
    w = World(budget=64, cache=False, policy="shortest")
    long, short, mid = w.submit([1] * 30), w.submit([2] * 2), w.submit([3] * 9)
    plan = w.batcher.plan()
    assert [r for r, _, _ in plan.chunks] == [short, mid, long]


def test_a_cached_prompt_reuses_its_prefix_and_reruns_its_last_token() -> None:
    w = World(budget=64)
    first = w.submit([7, 8, 9, 10, 11])
    w.run()
    again, longer = w.submit([7, 8, 9, 10, 11]), w.submit([7, 8, 9, 10, 11, 12, 13])
    plan = w.batcher.plan()
    assert (again.cached, longer.cached) == (4, 5)  # all but the last token; the whole cached prompt
    assert [(s, e) for _, s, e in plan.chunks] == [(4, 5), (5, 7)]
    w.forward(plan)
    w.batcher.launched(plan, RECORD)
    assert first.cached == 0 and w.whole()


def test_a_request_that_does_not_fit_waits_without_holding_anything() -> None:
    w = World(num_slots=20, budget=20, cache=False)
    a = w.submit([1] * 16)
    b = w.submit([2] * 10)
    plan = w.batcher.plan()
    assert [r for r, _, _ in plan.chunks] == [a] and w.batcher.blocked is b and b.slots is None
    assert w.pool.num_free == 4
    w.run()
    assert b.done == 10 and w.whole()


def test_a_failed_forward_releases_its_requests_and_keeps_what_was_cached_before() -> None:
    w = World(budget=8)
    b, a = w.submit([50, 51]), w.submit(list(range(12)))
    first = w.batcher.plan()
    w.forward(first)
    w.batcher.launched(first, RECORD)  # b finished; a's first 6 tokens are cached now
    c = w.submit([60, 61])
    second = w.batcher.plan()
    assert [r for r, _, _ in second.chunks] == [a, c]
    assert w.batcher.failed(second) == [a, c]
    assert a.slots is None and c.slots is None and not w.batcher.running
    assert w.cache.num_cached_tokens == 8 and w.cache.num_locked_tokens == 0  # b's 2 and a's first 6
    assert b.done == 2 and b.slots is None  # finished before, untouched
    retry = w.submit(list(range(12)))
    w.run()
    assert retry.cached == 6 and w.whole()


def test_cancelled_requests_are_skipped() -> None:
    w = World(budget=64, cache=False)
    a, b = w.submit([1, 2]), w.submit([3, 4])
    assert a.future.cancel()
    plan = w.batcher.plan()
    assert [r for r, _, _ in plan.chunks] == [b] and b.future.running()
    w.forward(plan)
    w.batcher.launched(plan, RECORD)
    assert w.whole()


def test_abort_gives_every_slot_back() -> None:
    w = World(budget=8)
    reqs = [w.submit(list(range(i, i + 12))) for i in range(3)]
    plan = w.batcher.plan()
    w.forward(plan)
    w.batcher.launched(plan, RECORD)
    assert set(map(id, w.batcher.abort())) == set(map(id, reqs))
    assert not w.batcher.has_work and w.whole()


@pytest.mark.parametrize("seed", range(3))
def test_random_load_under_kv_pressure_reads_only_its_own_prefixes(seed: int) -> None:
    """Prompts from a few shared prefixes arrive between forwards; a small pool makes the cache evict constantly;
    every chunk must read what its own tokens wrote, and nothing leaks."""
    rng = np.random.default_rng(seed)
    w = World(num_slots=96, budget=24)
    heads = [rng.integers(0, 50, int(rng.integers(4, 30))).tolist() for _ in range(4)]
    reqs, forwards = [], 0
    for _ in range(60):
        for _ in range(int(rng.integers(0, 3))):
            head = heads[int(rng.integers(len(heads)))][: int(rng.integers(0, 30))]
            reqs.append(w.submit(head + rng.integers(0, 50, int(rng.integers(1, 20))).tolist()))
        if w.batcher.has_work:
            plan = w.batcher.plan()
            assert plan is not None
            w.forward(plan)
            w.batcher.launched(plan, RECORD)
            forwards += 1
    w.run()
    assert all(r.done == r.num_tokens for r in reqs)
    assert sum(r.cached for r in reqs) > 0 and w.cache.num_evicted_tokens > 0
    assert w.whole()
