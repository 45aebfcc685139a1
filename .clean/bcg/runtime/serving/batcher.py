"""The one planner, without threads: which requests wait and run, what the next forward holds, and what becomes of
its requests' KV slots once it was launched or failed. The serving scheduler drives it from its thread;
:meth:`Engine.prefill <bcg.runtime.engine.Engine.prefill>` drives it inline on the caller's thread, over a
:class:`~bcg.runtime.kv_slots.SlotReservation` (no prefix cache, first come first served: every tensor-parallel
rank plans the same forwards).

Each forward packs chunks under a token budget (``chunked_prefill_size``): first the requests already running (a
long prompt part-way through, in the order they were admitted), then waiting ones in the order of the policy
(:mod:`.policy`), each request at most once per forward so its chunk's prefix is complete. A request is admitted
when it gets every KV slot it will need at once: it looks its prompt up in the prefix cache (at most all tokens
but the last, which must run to produce logits), locks what it reads, and allocates the rest (the pool evicts
unlocked cached prefixes to make room). So an admitted request never waits for slots again, and one that cannot be
admitted stays queued with nothing held. A prefill's requests are admitted at once instead: its reservation holds,
from the start, every slot its forwards will hold together, and each chunk takes its slots from it as it is packed
(so a finished prompt's slots serve later chunks of the same call).

After a forward is launched its chunks' KV is valid for every later forward (one stream orders them), so the
prefixes are inserted into the cache right away, the running request's lock moves to the longer prefix, and a
finished request unlocks and gives back the slots the cache did not adopt. A forward that raised leaves the cache
as it was before it, and its requests give back their own slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from bcg.ops.kv_cache import KVPool, KVPoolFullError
from bcg.runtime.batch import PrefillBatch
from bcg.runtime.kv_slots import SlotReservation, slots_held
from bcg.runtime.runner.telemetry import BatchRecord
from bcg.runtime.sampling import greedy_tokens
from bcg.runtime.serving.policy import FifoQueue
from bcg.runtime.serving.prefix_cache import PrefixCache
from bcg.runtime.serving.request import Request

__all__ = ["Batcher", "Plan", "finished_logits", "plan_chunks"]


@dataclass
class Plan:
    """One forward: ``chunks`` (request, first token, end token) in batch order, the packed ``batch``, and the
    requests it ends (in the order of the batch's logit rows)."""

    chunks: list[tuple[Request, int, int]]
    batch: PrefillBatch
    finishing: list[Request]


def finished_logits(plan: Plan, logits: Tensor) -> tuple[Tensor, Tensor] | None:
    """The logits of the requests ``plan`` ends, copied out of the forward's output (a view of the runner's static
    buffers after a replay: call it under the runner's lock), and their greedy next tokens; None when the forward
    ends no request. The one place a served or prefilled request's first token is chosen.
    """
    if not plan.finishing:
        return None
    rows = logits.clone()
    return rows, greedy_tokens(rows)


class Batcher:
    """Waiting and running requests of one scheduler and the plans of its forwards (one thread owns it).

    Args:
        pool: the engine's KV pool.
        cache: the prefix cache, or None (every request computes its whole prompt).
        budget: most tokens a forward holds.
        queue: the waiting queue (its policy).
        reservation: slots reserved for every request up front (a prefill), or None (each request is admitted
            when the pool can give it all its slots). With a reservation there is no cache.

    Example::

        batcher = Batcher(pool, PrefixCache(pool), budget=64, queue=FifoQueue())
        batcher.add(request)
        plan = batcher.plan()                     # admits the request, packs its first chunk
        finished = batcher.launched(plan, record) # after runner.forward(plan.batch) returned
    """

    def __init__(self, pool: KVPool, cache: PrefixCache | None, budget: int, queue: FifoQueue,
                 reservation: SlotReservation | None = None) -> None:
        if reservation is not None and cache is not None:
            raise ValueError("a reserved plan (a prefill) runs without the prefix cache; pass cache=None")
        self.pool, self.cache, self.budget, self.queue = pool, cache, budget, queue
        self.reservation = reservation
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
            future = req.future  # None: a prefill's request, which nobody can cancel
            if future is not None and future.cancelled():
                self.queue.pop()
                continue
            if not self.admit(req):
                self.blocked = req
                break
            self.queue.pop()
            if future is not None and not future.set_running_or_notify_cancel():  # cancelled since it was looked at
                self.release(req)
                continue
            self.running.append(req)
            take = min(req.remaining, budget)
            chunks.append((req, req.done, req.done + take))
            budget -= take
        return self._pack(chunks) if chunks else None

    def admit(self, req: Request) -> bool:
        """Gives ``req`` its cached prefix (locked) and every other slot it needs; False (nothing held) when the
        pool cannot supply them now. Under a reservation every request is admitted: its chunks take their slots
        from the reservation as they are packed."""
        if self.reservation is not None:
            req.slots = np.empty(req.num_tokens, dtype=np.int64)
            req.cached = req.done = 0
            return True
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
        """The forward of ``chunks``: the batch's arrays gathered in one pass, straight from the requests' numpy
        tokens and slots (a request's read slots, its prefix then its new ones, are its slots up to the chunk's
        end)."""
        reservation = self.reservation
        # Under a reservation the forward's new slots are taken at once: they are its write slots, back to back.
        fresh = reservation.take(sum(end - start for _, start, end in chunks)) if reservation is not None else None
        ids, write, read, seq_lens, prefix_lens, last = [], [], [], [], [], []
        offset = 0
        for i, (req, start, end) in enumerate(chunks):
            slots = req.slots
            if fresh is not None:
                slots[start:end] = fresh[offset : offset + end - start]
                offset += end - start
            else:
                write.append(slots[start:end])
            ids.append(req.tokens[start:end])
            read.append(slots[:end])
            seq_lens.append(end - start)
            prefix_lens.append(start)
            if end == req.num_tokens:
                last.append(i)
        one = len(chunks) == 1
        has_prefix = any(prefix_lens)
        batch = PrefillBatch.from_arrays(
            self.pool, ids[0] if one else np.concatenate(ids),
            fresh if fresh is not None else write[0] if one else np.concatenate(write), seq_lens, prefix_lens,
            (read[0] if one else np.concatenate(read)) if has_prefix else None,
            None if len(last) == len(chunks) else last, check=False)
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
        if self.reservation is not None:
            self.reservation.finished_forward()
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
            # Under a reservation only a finished request's slots are all filled in; a stopped one's chunks were
            # lent slots the reservation takes back itself when it is released.
            if self.reservation is None or req.done == req.num_tokens:
                own.append(req.own_slots())
            req.slots = None
        if not own:
            return
        slots = own[0] if len(own) == 1 else np.concatenate(own)
        if self.reservation is not None:  # back to the prefill's reservation, for its later chunks
            self.reservation.give(slots)
        elif slots.size:  # one call for the whole forward, in ascending order (the pool hands out its lowest)
            self.pool.free(torch.from_numpy(np.sort(slots)), check=False)


def plan_chunks(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """The forwards :meth:`Engine.prefill <bcg.runtime.engine.Engine.prefill>` runs for prompts of ``lengths``:
    per forward, ``(prompt, first token, end token)`` per chunk. A dry run of the planner over a scratch pool of
    bookkeeping only, for tools and tests that model the engine's chunking.

    Example::

        >>> plan_chunks([3, 6], 4)
        [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)], [(1, 5, 6)]]
    """
    pool = KVPool(int(slots_held(lengths, budget).max()), 0, 1, 1, torch.float32, "cpu")  # no layers: no memory
    reservation = SlotReservation(pool, lengths, budget)
    reservation.reserve()
    batcher = Batcher(pool, None, budget, FifoQueue(), reservation)
    for seq, n in enumerate(lengths):
        batcher.add(Request(torch.zeros(n, dtype=torch.int64), None, seq=seq))
    forwards, record = [], BatchRecord(0, 0, None, False, "dry run")
    while batcher.has_work:
        plan = batcher.plan()
        forwards.append([(req.seq, start, end) for req, start, end in plan.chunks])
        batcher.launched(plan, record)
    return forwards
