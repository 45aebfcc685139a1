"""A serving engine freezes the heap (a full collection would walk the model and the engine again: a 100+ ms stall
every thread meets) and thaws it when it closes; a capture keeps a frozen heap frozen; BCG_GC_FREEZE=0 leaves the heap
as it is. Prefill alone never freezes."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from bcg.bench.timing import gc_pauses
from bcg.runtime import Engine
from bcg.runtime.runner.build import frozen_gc

OPTS = dict(device="cpu", buckets=[8], chunked_prefill_size=8, kv_tokens=64, progress=False)


@pytest.fixture(autouse=True)
def thawed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("BCG_GC_FREEZE", "1")  # the suite turns it off (tests/conftest.py); here it is the subject
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_serving_engine_leaves_no_heap_for_a_full_collection_to_walk_until_it_closes() -> None:
    eng = Engine("tiny-dense", **OPTS)
    eng.prefill([[1, 2, 3]])
    assert gc.get_freeze_count() == 0  # prefill alone leaves the heap to the collector
    eng.submit([1, 2, 3]).result(timeout=60)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the model, the engine, the imports
    with frozen_gc():  # a capture meanwhile (a recapture, another engine's build) keeps them frozen
        pass
    assert gc.get_freeze_count() >= frozen
    eng.close()
    assert gc.get_freeze_count() == 0  # what the engine leaves behind can be collected again


def test_bcg_gc_freeze_0_leaves_the_heap_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_GC_FREEZE", "0")
    with Engine("tiny-dense", **OPTS) as eng:
        eng.submit([1, 2, 3]).result(timeout=60)
        assert gc.get_freeze_count() == 0


def test_gc_pauses_records_a_collection_from_any_thread() -> None:
    with gc_pauses() as pauses:
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
    assert pauses.num_full == 1 and pauses.max_ms >= 0 and len(pauses.ms[2]) == 1
