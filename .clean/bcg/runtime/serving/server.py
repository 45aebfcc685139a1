"""The request front end of an engine: futures from any thread, one scheduler thread packing them into forwards, one
completer thread handing out the results.

``submit`` validates nothing itself (the engine does) and never blocks: it puts the request in an inbox and wakes the
scheduler. The scheduler thread plans a forward on the host (:class:`~bcg.runtime.serving.batcher.Batcher`),
launches it through the runner, copies the finished requests' logits and takes their greedy tokens on the device,
records a CUDA event, and moves on to plan the next forward while the device still runs this one: nothing on its
path reads a device value, so it never waits for the GPU. At most ``max_inflight_batches`` forwards are launched and
not yet complete, so a queue of launched work never builds up ahead of newly arrived requests. The completer
thread (:mod:`.completer`) waits for each forward's event in turn, stamps the time to first token and resolves the
futures, whose tensors are then ready to read. On the CPU the forward is synchronous and the event is None; the
same threads run.

A forward that raises fails its own requests (their futures get the exception) and no other; one that raises a
``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) fails its requests too, then stops the scheduler, and the
engine with it. ``close`` stops the scheduler after the forward it is launching, lets launched forwards complete, and
fails every request that has not finished with :class:`~bcg.runtime.serving.request.EngineClosedError`.

Who waits for whom (the gate's rules, DESIGN.md): the scheduler waits for an in-flight slot (given back by the
completer, which waits only for the device) and for a recapture to end; the completer waits for the device and for
nothing else; neither runs a caller's code, because the futures' done-callbacks run on a third thread
(:mod:`.callbacks`), so a callback may call anything of the engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from bcg.errors import first_line
from bcg.ops.kv_cache import KVPool
from bcg.runtime.serving.batcher import Batcher, Plan, finished_logits
from bcg.runtime.serving.callbacks import CallbackThread, ServedFuture
from bcg.runtime.serving.completer import Completer, Completion, on_device
from bcg.runtime.serving.gate import ActivityGate
from bcg.runtime.serving.policy import make_queue
from bcg.runtime.serving.prefix_cache import PrefixCache
from bcg.runtime.serving.request import EngineClosedError, Request

__all__ = ["Server"]

logger = logging.getLogger("bcg")

# How long a scheduler that cannot admit anything waits before it tries again without being woken (slots freed by
# code outside the engine send no notification).
_BLOCKED_POLL_S = 0.05


class Server:
    """The scheduler and completer threads of one engine (started by the first :meth:`submit`).

    Args:
        forward: runs a :class:`~bcg.runtime.batch.PrefillBatch` (``Runner.forward``): its output's logits rows are
            the batch's wanted requests.
        lock: held around ``forward`` and the reading of its logits (``Runner.lock``).
        pool: the KV pool.
        cache: the prefix cache, or None.
        gate: the engine's :class:`~bcg.runtime.serving.gate.ActivityGate`.
        budget: most tokens a forward holds (``chunked_prefill_size``).
        policy: the waiting queue's order (:mod:`.policy`).
        max_inflight: most forwards launched and not yet complete.
        device: the engine's device.
    """

    def __init__(self, *, forward: Callable[[Any], Any], lock: Any, pool: KVPool, cache: PrefixCache | None,
                 gate: ActivityGate, budget: int, policy: str, max_inflight: int, device: torch.device) -> None:
        self._forward, self._lock, self.gate, self.device = forward, lock, gate, device
        self.pool, self.cache = pool, cache
        self.batcher = Batcher(pool, cache, budget, make_queue(policy))
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._woken = False  # slots were freed since the scheduler last planned
        self._closed = False
        self.failure: str | None = None  # why the scheduler stopped, if it died (the engine is closed then)
        self._holding = False  # counted as a holder of slots in the gate
        self._seq = itertools.count()
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self.num_submitted = self.num_failed = 0
        self._started = False
        self._start_lock = threading.Lock()
        self._scheduler = threading.Thread(target=self._schedule, name="bcg-scheduler", daemon=True)
        self._completer = Completer(gate=gate, inflight=self._inflight, fail=self._fail,
                                    done=lambda: self._callbacks.stop(), device=device)
        self._callbacks = CallbackThread([self._scheduler, self._completer.thread])

    # ---------------------------------------------------------------- front end
    def submit(self, ids: Tensor) -> Future:
        """Queues a validated prompt (CPU int64); returns the future of its
        :class:`~bcg.runtime.serving.request.RequestResult`."""
        self._check_open()
        self._start()
        future: Future = ServedFuture(self._callbacks)
        with self._cond:
            self._check_open()
            self._inbox.append(Request(ids, future, seq=next(self._seq)))
            self.num_submitted += 1
            self._cond.notify()
        return future

    def close(self) -> None:
        """Stops the threads (after the forward being launched; launched ones complete) and fails every request that
        has not finished with EngineClosedError. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.gate.remove_listener(self._wake)
        with self._start_lock:  # a submit racing with close starts no thread after this
            if not self._started:
                return
        me = threading.current_thread()
        if me in (self._scheduler, self._completer.thread):  # a finalizer run there: the threads end by themselves
            return
        self._scheduler.join()
        self._completer.join()
        if me is not self._callbacks.thread:  # close() from a done-callback: the callback thread ends after it
            self._callbacks.join()

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (approximate while the scheduler runs)."""
        with self._cond:
            return len(self._inbox) + len(self.batcher.queue)

    @property
    def num_finished(self) -> int:
        """Requests whose futures the completer resolved with a result."""
        return self._completer.num_finished

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(self.failure or "the engine is closed; build a new one to submit prompts")

    def _start(self) -> None:
        with self._start_lock:
            if not self._started and not self._closed:
                self._started = True
                self.gate.add_listener(self._wake)
                self._callbacks.start()  # first: the others hand it callbacks
                self._scheduler.start()
                self._completer.start()

    def _wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    # ---------------------------------------------------------------- the scheduler thread
    def _schedule(self) -> None:
        try:
            with torch.inference_mode(), on_device(self.device):
                self._schedule_loop()
        except BaseException as e:  # a bug or an interrupt: fail everything rather than leave futures hanging
            self.failure = f"the engine's scheduler stopped ({first_line(e)})"
            logger.error("bcg: %s", self.failure, exc_info=True)
        finally:
            with self._cond:
                self._closed = True
                arrivals, self._inbox = self._inbox, []
            for req in arrivals:
                self.batcher.add(req)
            error = EngineClosedError(self.failure or "the engine was closed before this request finished")
            self._fail(self.batcher.abort(), error)
            self._set_holding()
            if self.cache is not None:  # nothing runs any more: what the cache holds goes back to the pool
                self.cache.clear()
            self._completer.stop()

    def _schedule_loop(self) -> None:
        while True:
            self._inflight.acquire()  # planned with the newest arrivals once a forward slot is free
            with self._cond:
                while not (self._closed or self._inbox or self.batcher.has_work):
                    self._cond.wait()
                if self._closed:
                    self._inflight.release()
                    return
                arrivals, self._inbox, self._woken = self._inbox, [], False
            for req in arrivals:
                self.batcher.add(req)
            self._set_holding(True)  # admission takes slots: a holder before it takes any, not after
            plan = self.batcher.plan()
            self._set_holding()
            if plan is None:
                self._inflight.release()
                self._when_blocked()
                continue
            self._launch(plan)

    def _when_blocked(self) -> None:
        """Nothing could be admitted: fail the head request if nothing of this engine will ever free its slots,
        else wait for slots, arrivals or close."""
        req = self.batcher.blocked
        if req is None:
            return
        if not self.batcher.running:
            alone, admitted = self.gate.if_no_holders(lambda: self.batcher.admit(req))
            if alone and not admitted:
                self.batcher.queue.pop()
                self._fail([req], ValueError(self._refusal(req)))
                return
            if alone:  # the slots came back meanwhile: give them up and plan again
                self.batcher.release(req)
                return
        with self._cond:
            if not (self._woken or self._inbox or self._closed):
                self._cond.wait(timeout=_BLOCKED_POLL_S)

    def _refusal(self, req: Request) -> str:
        pool = self.pool
        if req.num_tokens > pool.num_slots:
            return (f"the prompt needs {req.num_tokens} KV slots but the pool holds {pool.num_slots}; raise "
                    "kv_tokens (or kv_memory_fraction on CUDA) or shorten it")
        return (f"the prompt needs {req.num_tokens} KV slots but the pool has {pool.num_free} of {pool.num_slots} "
                "free and nothing of this engine holds the rest (allocated outside it); free them or raise kv_tokens")

    def _launch(self, plan: Plan) -> None:
        now = time.perf_counter()
        for req, _, _ in plan.chunks:
            if req.first_launch is None:
                req.first_launch = now
        self.gate.enter()
        try:
            with self._lock:
                out = self._forward(plan.batch)
                logits, next_tokens = finished_logits(plan, out.logits) or (None, None)
                event = self._record_event()
        except BaseException as e:  # this forward's requests fail, nobody else's; an interrupt then stops the loop
            self.gate.exit()
            self._inflight.release()
            self._fail(self.batcher.failed(plan), e)
            self._set_holding()
            self.gate.notify()
            if not isinstance(e, Exception):
                raise
            return
        try:
            finished = self.batcher.launched(plan, out.record)
        except BaseException as e:  # a bug in the bookkeeping: this forward's requests fail, then the scheduler stops
            self._fail([req for req, _, _ in plan.chunks], e)
            self.gate.exit()
            self._inflight.release()
            raise
        self._set_holding()
        if finished:
            self.gate.notify()  # slots freed or evictable: waiting reservations may proceed
        self._completer.put(Completion(finished, logits, next_tokens, event))

    def _record_event(self) -> Any:
        """Marks the end of the forward just launched on the device's stream (None on the CPU, where it is over)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _set_holding(self, holding: bool | None = None) -> None:
        """Counts the scheduler as a holder of slots in the gate while it runs requests or admits them (a prefill
        short of slots then waits for them instead of failing); ``holding`` overrides what the running requests say."""
        if holding is None:
            holding = bool(self.batcher.running)
        if holding != self._holding:
            self._holding = holding
            self.gate.hold() if holding else self.gate.release()

    def _fail(self, reqs: list[Request], error: BaseException) -> None:
        for req in reqs:
            if not req.future.done() and (req.future.running() or req.future.set_running_or_notify_cancel()):
                req.future.set_exception(error)
                self.num_failed += 1
