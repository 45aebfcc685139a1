"""The threads behind Engine.submit on the CPU: an engine used only for prefill starts none, the scheduler launches
up to max_inflight_batches forwards ahead of a device that has not finished, and an engine dropped without close
stops its threads."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from submit_helpers import COMMON
from threads import wait_for

from bcg.runtime import Engine


def test_an_engine_used_only_for_prefill_starts_no_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    with Engine("tiny-dense", backend="eager", device="cpu", progress=False, kv_tokens=64) as eng:
        eng.prefill([[1, 2, 3]])
        assert eng._server is None
    assert {t.name for t in threading.enumerate()} <= before | {"MainThread"}


class SlowDevice:
    """A stand-in device event per forward that completes only when the test says so."""

    def __init__(self) -> None:
        self.events: list[threading.Event] = []
        self.lock = threading.Lock()

    def record(self) -> Any:
        done = threading.Event()
        with self.lock:
            self.events.append(done)

        class Event:
            def synchronize(self) -> None:
                assert done.wait(20)

        return Event()


@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_the_next_forward_is_launched_while_the_device_runs_the_last(inflight: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With a device that has not finished, the scheduler launches up to max_inflight_batches forwards and then
    waits; each future resolves only once its forward's event completed."""
    eng = Engine("tiny-dense", backend="breakable", seed=0, progress=False, max_inflight_batches=inflight, **COMMON)
    device = SlowDevice()
    with eng:
        futures = [eng.submit([1, 2, 3])]
        futures[0].result(timeout=60)  # before the stand-in: completes as on a CPU
        monkeypatch.setattr(eng._server, "_record_event", device.record)
        # One request per forward: each arrives after the previous forward was launched.
        for i in range(inflight + 2):
            futures.append(eng.submit([5, 6, 7 + i]))
            if i < inflight:
                wait_for(lambda n=i: len(device.events) == n + 1)
        time.sleep(0.05)
        assert len(device.events) == inflight  # no forward beyond max_inflight_batches ahead of the device
        assert not any(f.done() for f in futures[1:])  # launched, not complete: nobody's result yet
        device.events[0].set()
        assert futures[1].result(timeout=60).logits.shape == (1, 256)
        wait_for(lambda: len(device.events) == inflight + 1)  # a slot freed: the next forward launched at once
        for e in list(device.events):
            e.set()
        while not all(f.done() for f in futures):
            for e in list(device.events):
                e.set()
            time.sleep(0.002)
        assert all(f.exception() is None for f in futures)


def test_an_engine_dropped_without_close_stops_its_threads() -> None:
    import gc
    import weakref

    def new_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("bcg-")} - before

    before: set = set()
    before = new_threads()
    eng = Engine("tiny-dense", backend="breakable", seed=0, progress=False, **COMMON)
    assert eng.submit([1, 2, 3]).result(timeout=60).cached_tokens == 0
    assert {t.name for t in new_threads()} == {"bcg-scheduler", "bcg-completer", "bcg-callbacks"}
    pool = weakref.ref(eng.kv_pool)
    del eng
    gc.collect()
    wait_for(lambda: not new_threads())
    assert pool() is None  # nothing of the engine is kept alive by its threads
