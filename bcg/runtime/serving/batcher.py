"""The scheduler's decisions, without threads: which requests wait and run, what the next forward holds, and what
becomes of its requests' KV slots once it was launched or failed.

Each forward packs chunks under a token budget (``chunked_prefill_size``): first the requests already running (a
long prompt part-way through, in the order they were admitted), then waiting ones in the order of the policy
(:mod:`.policy`), each request at most once per forward so its chunk's prefix is complete. A request is admitted
when it gets every KV slot it will need at once: it looks its prompt up in the prefix cache (at most all tokens
but the last, which must run to produce logits), locks what it reads, and allocates the rest (the pool evicts
unlocked cached prefixes to make room). So an admitted request never waits for slots again, and one that cannot be
admitted stays queued with nothing held.

After a forward is launched its chunks' KV is valid for every later forward (one stream orders them), so the
prefixes are inserted into the cache right away, the running request's lock moves to the longer prefix, and a
finished request unlocks and gives back the slots the cache did not adopt. A forward that raised leaves the cache
as it was before it, and its requests give back their own slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bcg.ops.kv_cache import KVPool, KVPoolFullError
from bcg.runtime.batch import PrefillBatch, PrefillItem
from bcg.runtime.runner.telemetry import BatchRecord
from bcg.runtime.serving.policy import FifoQueue
from bcg.runtime.serving.prefix_cache import PrefixCache
from bcg.runtime.serving.request import Request

__all__ = ["Batcher", "Plan"]


@dataclass
class Plan:
    """One forward: ``chunks`` (request, first token, end token) in batch order, the packed ``batch``, and the
    requests it ends (in the order of the batch's logit rows)."""

    chunks: list[tuple[Request, int, int]]
    batch: PrefillBatch
    finishing: list[Request]


class Batcher:
    """Waiting and running requests of one scheduler and the plans of its forwards (one thread owns it).

    Args:
        pool: the engine's KV pool.
        cache: the prefix cache, or None (every request computes its whole prompt).
        budget: most tokens a forward holds.
        queue: the waiting queue (its policy).

    Example::

        batcher = Batcher(pool, PrefixCache(pool), budget=64, queue=FifoQueue())
        batcher.add(request)
        plan = batcher.plan()                     # admits the request, packs its first chunk
        finished = batcher.launched(plan, record) # after runner.forward(plan.batch) returned
    """

    def __init__(self, pool: KVPool, cache: PrefixCache | None, budget: int, queue: FifoQueue) -> None:
        self.pool, self.cache, self.budget, self.queue = pool, cache, budget, queue
        self._alloc = cache.alloc if cache is not None else pool.alloc  # the cache evicts for a shortfall first
        self.running: list[Request] = []
        self.blocked: Request | None = None  # the request the last plan could not admit (no slots)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.queue) > 0

    def add(self, request: Request) -> None:
        self.queue.push(request)

    # ---------------------------------------------------------------- planning
    def plan(self) -> Plan | None:
        """The next forward, or None when nothing can run (nothing waits, or what waits cannot get its slots:
        :attr:`blocked`)."""
        budget, chunks = self.budget, []
        for req in self.running:
            if budget == 0:
                break
            take = min(req.remaining, budget)
            chunks.append((req, req.done, req.done + take))
            budget -= take
        self.blocked = None
        while budget > 0:
            req = self.queue.peek()
            if req is None:
                break
            if req.future.cancelled():
                self.queue.pop()
                continue
            if not self.admit(req):
                self.blocked = req
                break
            self.queue.pop()
            if not req.future.set_running_or_notify_cancel():  # cancelled since it was looked at
                self.release(req)
                continue
            self.running.append(req)
            take = min(req.remaining, budget)
            chunks.append((req, req.done, req.done + take))
            budget -= take
        return self._pack(chunks) if chunks else None

    def admit(self, req: Request) -> bool:
        """Gives ``req`` its cached prefix (locked) and every other slot it needs; False (nothing held) when the
        pool cannot supply them now."""
        hit = self.cache.lookup(req.tokens, req.num_tokens - 1) if self.cache is not None else None
        cached = hit.length if hit is not None else 0
        try:
            own = self._alloc(req.num_tokens - cached).numpy()
        except KVPoolFullError:
            if hit is not None:
                self.cache.unlock(hit.node)
            return False
        req.slots = np.concatenate([hit.slots, own]) if cached else own
        req.cached = req.done = cached
        if self.cache is not None:
            req.node = hit.node
            req.adopted = np.zeros(req.num_tokens, dtype=bool)
        return True

    def _pack(self, chunks: list[tuple[Request, int, int]]) -> Plan:
        items, last = [], []
        for i, (req, start, end) in enumerate(chunks):
            slots = req.slots
            items.append(PrefillItem.unchecked(req.ids[start:end], torch.from_numpy(slots[start:end]), start,
                                               torch.from_numpy(slots[:start])))
            if end == req.num_tokens:
                last.append(i)
        batch = PrefillBatch(items, self.pool, None if len(last) == len(items) else last, check=False)
        return Plan(chunks, batch, [chunks[i][0] for i in last])

    # ---------------------------------------------------------------- after a forward
    def launched(self, plan: Plan, record: BatchRecord) -> list[Request]:
        """``plan``'s forward was launched: its prefixes join the cache, finished requests give back what the cache
        did not adopt. Returns the finished requests (``plan.finishing``)."""
        for req, _start, end in plan.chunks:
            req.batches.append(record)
            req.done = end
            if self.cache is not None:
                # Locked as it is inserted (a prefill's allocation may evict meanwhile), before the shorter prefix's
                # lock goes, so the shared part never drops to no lock.
                node, adopted_from = self.cache.insert(req.tokens[:end], req.slots[:end], lock=True)
                req.adopted[adopted_from:end] = True
                self.cache.unlock(req.node)
                req.node = node
        if plan.finishing:
            done = set(map(id, plan.finishing))
            self.running = [r for r in self.running if id(r) not in done]
            self._release_all(plan.finishing)
        return plan.finishing

    def failed(self, plan: Plan) -> list[Request]:
        """``plan``'s forward raised: its requests stop and give back their own slots (what earlier forwards
        cached stays cached). Returns them; the caller fails their futures."""
        reqs = [req for req, _, _ in plan.chunks]
        gone = set(map(id, reqs))
        self.running = [r for r in self.running if id(r) not in gone]
        self._release_all(reqs)
        return reqs

    def abort(self) -> list[Request]:
        """Stops every waiting and running request, giving their slots back; returns them."""
        reqs = self.running + self.queue.drain()
        self.running = []
        self._release_all(reqs)
        return reqs

    def release(self, req: Request) -> None:
        """Gives back what ``req`` holds (its lock and its own slots); a request holds nothing afterwards."""
        self._release_all([req])

    def _release_all(self, reqs: list[Request]) -> None:
        own = []
        for req in reqs:
            if req.slots is None:
                continue
            if self.cache is not None:
                self.cache.unlock(req.node)
                req.node = None
            own.append(req.own_slots())
            req.slots = None
        if own:
            slots = np.sort(np.concatenate(own))
            if slots.size:  # one call for the whole forward, in ascending order (the pool hands out its lowest)
                self.pool.free(torch.from_numpy(slots), check=False)
