"""The capture-time leak detector: tensors an eager function allocates, keeps, and neither returns nor writes."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import bcg
from bcg.leaks import LeakError, LeakWarning, mark_private

STASH: list[torch.Tensor] = []


class Cache:
    def __init__(self) -> None:
        self.scratch: torch.Tensor | None = None


cache = Cache()


@bcg.eager_on_graph
def stash_on_global(x):
    y = x * 2
    STASH.append(y)  # the bug class: a later segment reading STASH[0] reads the capture-time tensor forever
    return None


@bcg.eager_on_graph
def stash_a_view_on_self(x):
    cache.scratch = (x + 1)[1:]
    return x.sum(0, keepdim=True)


@bcg.eager_on_graph
def returns_fresh(x):
    tmp = x.exp()
    return {"out": tmp * 2, "view": tmp[:2]}


@bcg.eager_on_graph
def writes_into_arg(x, out):
    tmp = x * 3  # a temporary that dies
    out.copy_(tmp)
    cache.scratch = out[1:]  # a view of an argument is not a leak


def _capture(fn, *args, **kwargs):
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g, **kwargs):
        fn(*args)
    return g


@pytest.fixture(autouse=True)
def _clean():
    STASH.clear()
    cache.scratch = None
    yield
    STASH.clear()
    cache.scratch = None


@pytest.mark.parametrize("fn", [stash_on_global, stash_a_view_on_self])
def test_a_stashed_allocation_warns(fn) -> None:
    x = torch.randn(4, 8)
    with pytest.warns(LeakWarning, match=rf"{fn.__name__}.*allocated 1 tensor.*shape=\[\d, 8\]"):
        _capture(fn, x, leak_check="warn")


def test_raise_mode_fails_the_capture() -> None:
    g = bcg.BreakableCUDAGraph(emulate=True)
    with pytest.raises(LeakError, match="stash_on_global"):
        with bcg.breakable_graph(g, leak_check="raise"):
            stash_on_global(torch.randn(4, 8))
    assert not g.is_captured


@pytest.mark.parametrize("fn", [returns_fresh, writes_into_arg])
def test_returned_or_written_tensors_are_not_flagged(fn) -> None:
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeakWarning)
        g = _capture(fn, x, torch.empty(4, 8), leak_check="raise") if fn is writes_into_arg else \
            _capture(fn, x, leak_check="raise")
    g.replay()


@bcg.eager_on_graph
def caches_privately(x):
    STASH.append(mark_private(x * 2))  # kept for later eager calls only, and declared so
    return None


def test_a_cache_declared_private_is_not_flagged() -> None:
    _capture(caches_privately, torch.randn(4, 8), leak_check="raise")
    assert len(STASH) == 1
    mark_private(torch.zeros(1))  # outside any check: nothing to tell, no error


def test_the_env_var_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_LEAK_CHECK", "raise")
    with pytest.raises(LeakError):
        _capture(stash_on_global, torch.randn(2, 8))
    monkeypatch.setenv("BCG_LEAK_CHECK", "off")
    _capture(stash_on_global, torch.randn(2, 8))
    with pytest.raises(ValueError, match="leak_check"):
        bcg.breakable_graph(bcg.BreakableCUDAGraph(emulate=True), leak_check="loud")


def test_off_costs_nothing_and_replay_never_checks() -> None:
    seen = []

    @bcg.eager_on_graph
    def probe(x):
        seen.append(_get_current_dispatch_mode())
        return x + 1

    x = torch.randn(4)
    g = _capture(probe, x, leak_check="off")
    g2 = _capture(probe, x, leak_check="warn")
    g.replay()
    g2.replay()
    assert seen[0] is None and seen[1] is not None  # off: the function runs bare; warn: under the recorder
    assert seen[2:] == [None, None]  # replay runs bare whatever the capture's setting


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_the_models_islands_leak_nothing(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.runtime import Engine

    monkeypatch.setenv("BCG_LEAK_CHECK", "raise")
    eng = Engine(preset, backend="breakable", device="cpu", buckets=[8, 16], progress=False)
    assert eng.telemetry.num_captured == 2, eng.telemetry.buckets
