"""What the callers of one engine wait on: a recapture waits for quiet, forwards wait while a recapture runs, and a
KV reservation that finds too few free slots waits while some holder of this engine's slots will give them back.

Every path that runs forwards (``Engine.prefill`` and the serving scheduler) and every path that holds KV slots
(a prefill's :class:`~bcg.runtime.kv_slots.SlotReservation`, the scheduler's running requests) reports here, so each of
them sees the others: a prefill waits for slots the scheduler holds instead of failing, and the scheduler is woken
when a prefill gives slots back.

Who may wait for whom (DESIGN.md has the rules and why): a thread waits for slots (:meth:`ActivityGate.reserve`)
before it enters as a forward, never while it counts as one, so a recapture (:meth:`ActivityGate.quiet`) waits only
for forwards that will end; the threads that end forwards (the completer) and hold slots (the scheduler) never run a
caller's code; every enter has its exit on every path, ``BaseException`` included.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from bcg.ops.kv_cache import KVPool, KVPoolFullError

__all__ = ["ActivityGate"]

T = TypeVar("T")


class ActivityGate:
    """Forwards in flight, holders of KV slots and recaptures of one engine, and the condition they wait on.

    Example::

        >>> gate = ActivityGate()
        >>> with gate.active():
        ...     gate.num_active
        1
        >>> with gate.quiet():       # a recapture: no forward runs meanwhile
        ...     gate.num_recaptures
        1
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.num_active = 0  # forwards in flight (a forward counts until its result is complete)
        self.num_holders = 0  # reservations of KV slots that will be given back (prefills, the scheduler)
        self.num_recaptures = 0
        self._listeners: list[Callable[[], Any]] = []

    # ---------------------------------------------------------------- forwards and recaptures
    def enter(self) -> None:
        """A forward starts: waits while a recapture runs."""
        with self._cond:
            while self.num_recaptures:
                self._cond.wait()
            self.num_active += 1

    def exit(self) -> None:
        """A forward (and whatever reads its result on the device) is over."""
        with self._cond:
            self.num_active -= 1
            self._cond.notify_all()

    @contextmanager
    def active(self) -> Iterator[None]:
        """:meth:`enter` and :meth:`exit` around a block."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """A recapture: new forwards wait, and the block starts once those in flight are over (on CUDA another
        thread's host syncs and allocations during a capture would invalidate it)."""
        with self._cond:
            self.num_recaptures += 1
            try:
                while self.num_active:
                    self._cond.wait()
            except BaseException:  # interrupted while waiting: forwards must not wait for a recapture never run
                self.num_recaptures -= 1
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            with self._cond:
                self.num_recaptures -= 1
                self._cond.notify_all()

    # ---------------------------------------------------------------- KV slots
    def reserve(self, reserve: Callable[[], None], need: int, pool: KVPool) -> None:
        """Calls ``reserve`` (which takes ``need`` slots of ``pool`` or raises :class:`KVPoolFullError`), waiting
        while other holders of this engine's slots will give theirs back; the caller then holds until
        :meth:`release`.

        Raises:
            ValueError: ``need`` exceeds the pool, or the pool lacks the slots and nothing of this engine holds them
                (they are allocated outside it).
        """
        if need > pool.num_slots:
            raise ValueError(f"the prompts need {need} KV slots at once but the pool holds {pool.num_slots}; raise "
                             "kv_tokens (or kv_memory_fraction on CUDA) or prefill fewer/shorter prompts")
        with self._cond:
            while True:
                try:
                    reserve()
                except KVPoolFullError:
                    if self.num_holders == 0:  # nothing of this engine will free them: held by someone else
                        raise ValueError(f"the prompts need {need} KV slots but the pool has {pool.num_free} of "
                                         f"{pool.num_slots} free (the rest are allocated outside prefill); free "
                                         "them or raise kv_tokens") from None
                    self._cond.wait()
                else:
                    self.num_holders += 1
                    return

    def hold(self) -> None:
        """Starts holding slots that will be given back (without waiting: the scheduler's requests)."""
        with self._cond:
            self.num_holders += 1

    def release(self) -> None:
        """A holder gave its slots back: wakes every waiter."""
        with self._cond:
            self.num_holders -= 1
        self.notify()

    def if_no_holders(self, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """``(True, fn())`` with no holder of slots, run while none can start holding (reservations take the same
        lock); ``(False, None)`` when some holder exists."""
        with self._cond:
            if self.num_holders:
                return False, None
            return True, fn()

    def notify(self) -> None:
        """Slots went back to the pool (or became evictable): wakes waiting reservations and the listeners."""
        with self._cond:
            self._cond.notify_all()
        for listener in list(self._listeners):  # outside the lock: a listener takes its own
            listener()

    def add_listener(self, fn: Callable[[], Any]) -> None:
        """Calls ``fn()`` (from any thread) whenever :meth:`notify` runs."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], Any]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)
