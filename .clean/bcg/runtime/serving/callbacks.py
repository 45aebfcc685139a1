"""Done-callbacks of served futures run on a thread of their own, never on the scheduler or the completer.

A future's done-callbacks run in the thread that resolves it. Resolved by the completer (or failed by the scheduler),
a callback that calls back into the engine (``close()``, ``recapture()``, ``prefill()``, waiting for another
future) would wait for work only the thread running it can do: the completer's next forward, an in-flight slot it
gives back, the scheduler it would join. So a :class:`ServedFuture` hands the callbacks that fire on one of the
engine's own threads to a :class:`CallbackThread`, which runs them in order; a callback added to a future that is
already done runs at once in the caller's thread, as with any future. ``result()`` and ``concurrent.futures.wait``
wake without the hop: only callbacks move.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["CallbackThread", "ServedFuture", "served_result"]

logger = logging.getLogger("bcg")


class CallbackThread:
    """Runs callbacks handed over by the engine's threads, in order, until :meth:`stop`.

    Args:
        engine_threads: the threads whose callbacks move here (the scheduler and the completer).

    Example::

        callbacks = CallbackThread([scheduler, completer]); callbacks.start()
        future = ServedFuture(callbacks)
        future.add_done_callback(lambda f: eng.close())   # safe: runs on "bcg-callbacks"
        callbacks.stop(); callbacks.join()
    """

    def __init__(self, engine_threads: list[threading.Thread]) -> None:
        self.engine_threads = frozenset(engine_threads)
        self._queue: queue.SimpleQueue[tuple[Callable[[Any], Any], Any] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="bcg-callbacks", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ends the thread once every callback handed over so far ran (call after the engine's threads ended)."""
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def call(self, fn: Callable[[Any], Any], future: Any) -> None:
        """``fn(future)``: here when called on one of the engine's threads, else at once."""
        if threading.current_thread() in self.engine_threads and self.thread.is_alive():
            self._queue.put((fn, future))
        else:
            _call(fn, future)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _call(*item)


def _call(fn: Callable[[Any], Any], future: Any) -> None:
    try:
        fn(future)
    except Exception:  # as concurrent.futures does: a callback's error is logged, never raised into the engine
        logger.exception("bcg: exception calling a done-callback of %r", future)


class ServedFuture(Future):
    """A :class:`concurrent.futures.Future` whose done-callbacks never run on the engine's own threads."""

    def __init__(self, callbacks: CallbackThread) -> None:
        super().__init__()
        self._callbacks = callbacks

    def add_done_callback(self, fn: Callable[[Future], object]) -> None:
        """As :meth:`Future.add_done_callback`; fired by the engine, ``fn`` runs on the callback thread."""
        callbacks = self._callbacks
        super().add_done_callback(lambda f: callbacks.call(fn, f))

    def add_done_callback_inline(self, fn: Callable[[Future], object]) -> None:
        """``fn`` runs on whichever thread resolves the future, without the callback thread's hop: for a callback
        that only hands the outcome on and never blocks or calls into the engine (an event loop's
        ``call_soon_threadsafe``)."""
        super().add_done_callback(fn)


async def served_result(future: Future) -> Any:
    """Awaits ``future`` on the running event loop: its outcome is handed to the loop straight from the thread that
    resolves it (``call_soon_threadsafe`` never blocks), without the callback thread's hop; cancelling the awaiting
    task cancels the request if it has not started."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def resolved(f: Future) -> None:
        try:
            loop.call_soon_threadsafe(_settle, waiter, f)
        except RuntimeError:  # the loop was closed meanwhile: nobody awaits the answer any more
            pass

    getattr(future, "add_done_callback_inline", future.add_done_callback)(resolved)  # any Future works, slower
    try:
        return await waiter
    except asyncio.CancelledError:
        future.cancel()
        raise


def _settle(waiter: asyncio.Future, future: Future) -> None:
    """Gives ``future``'s outcome to the event loop's ``waiter`` (on the loop's thread)."""
    if waiter.done():
        return
    if future.cancelled():
        waiter.cancel()
    elif future.exception() is not None:
        waiter.set_exception(future.exception())
    else:
        waiter.set_result(future.result())
