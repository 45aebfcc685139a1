"""The completer thread of an engine's server: it waits for each launched forward's device event in turn, stamps
the time to first token and resolves the finishing requests' futures, whose tensors are then ready to read.

It waits for the device and for nothing else (the gate's rules, DESIGN.md): a completed forward leaves the gate and
gives its in-flight slot back to the scheduler before its futures resolve, and the futures' done-callbacks run on
the callback thread (:mod:`.callbacks`), never here.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bcg.runtime.serving.gate import ActivityGate
from bcg.runtime.serving.request import Request

__all__ = ["Completer", "Completion", "on_device"]


@dataclass
class Completion:
    """One launched forward, handed from the scheduler to the completer."""

    finishing: list[Request]
    logits: Tensor | None
    next_tokens: Tensor | None
    event: Any  # torch.cuda.Event, or None on the CPU


def on_device(device: torch.device) -> Any:
    """``device`` made current for the thread (a no-op context off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class Completer:
    """The completer thread (started by :meth:`start`, ended by :meth:`stop` once the scheduler hands over no more).

    Args:
        gate: the engine's :class:`~bcg.runtime.serving.gate.ActivityGate` (a completed forward exits it).
        inflight: the scheduler's in-flight semaphore (a completed forward releases one slot).
        fail: fails requests with an exception (the server's, which counts them).
        done: called when the thread ends, after the last future it resolves (stops the callback thread).
        device: the engine's device.
    """

    def __init__(self, *, gate: ActivityGate, inflight: threading.BoundedSemaphore,
                 fail: Callable[[list[Request], BaseException], None], done: Callable[[], None],
                 device: torch.device) -> None:
        self.gate, self._inflight, self._fail, self._done, self.device = gate, inflight, fail, done, device
        self._completions: queue.SimpleQueue[Completion | None] = queue.SimpleQueue()
        self.num_finished = 0
        self.thread = threading.Thread(target=self._complete, name="bcg-completer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def put(self, item: Completion) -> None:
        """Hands a launched forward over (from the scheduler thread)."""
        self._completions.put(item)

    def stop(self) -> None:
        """Ends the thread after the forwards handed over so far (the scheduler's last call)."""
        self._completions.put(None)

    def _complete(self) -> None:
        try:
            with torch.inference_mode(), on_device(self.device):
                while True:
                    item = self._completions.get()
                    if item is None:
                        return
                    self._resolve(item)
        finally:
            self._done()  # after the last future this thread resolves: its callbacks were handed over

    def _resolve(self, item: Completion) -> None:
        try:
            if item.event is not None:
                item.event.synchronize()
        except Exception as e:  # the device failed this forward: its requests fail
            self._over()
            self._fail(item.finishing, e)
            return
        now = time.perf_counter()
        # The forward is over before its futures resolve: whoever wakes on one (a done-callback, a thread in result())
        # may recapture at once, and finds this forward no longer counted as active.
        self._over()
        try:
            if not item.finishing:
                return
            # One split per forward rather than two slicing ops per request: the completer's Python holds the
            # interpreter lock the scheduler needs.
            rows, tokens = item.logits.split(1), item.next_tokens.split(1)
            for req, logits, next_tokens in zip(item.finishing, rows, tokens):
                req.future.set_result(req.result(logits, next_tokens, now))
            self.num_finished += len(item.finishing)
        except Exception as e:  # a bug reading the result: these requests fail, the others go on
            self._fail(item.finishing, e)

    def _over(self) -> None:
        """A launched forward completed: it is no longer active, and its in-flight slot is free."""
        self.gate.exit()
        self._inflight.release()
