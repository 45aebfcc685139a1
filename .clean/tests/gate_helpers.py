"""Shared by the gate's tests (test_gate_rules, test_submit_refusals): small CPU engines, a lone eager reference to
check answers against, the engine's threads, and a served forward held until the test lets it go."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_cache import max_diff
from threads import HANG_S

from bcg.runtime import Engine

SMALL = dict(device="cpu", buckets=[8, 16], chunked_prefill_size=16, kv_tokens=64, seed=0, progress=False)
_reference: dict[str, Engine] = {}


def reference(prompt: list[int]) -> Any:
    """A lone eager prefill of ``prompt`` (cache off)."""
    if "eager" not in _reference:
        _reference["eager"] = Engine("tiny-dense", backend="eager", prefix_cache=False, **SMALL)
    return _reference["eager"].prefill([prompt])


def same(res: Any, prompt: list[int]) -> bool:
    """An answer equal to the lone eager prefill of ``prompt``."""
    ref = reference(prompt)
    return max_diff(res.logits, ref.logits) <= 1e-5 and torch.equal(res.next_tokens.cpu(), ref.next_tokens.cpu())


def threads_of(eng: Engine) -> list[threading.Thread]:
    """The serving threads of ``eng``: scheduler, completer and callbacks (none before its first submit)."""
    server = eng._server
    if server is None:
        return []
    return [server._scheduler, server._completer.thread, server._callbacks.thread]


def stopped(eng: Engine) -> bool:
    """None of ``eng``'s serving threads is alive."""
    return not any(t.is_alive() for t in threads_of(eng))


def hold_first_served_forward(eng: Engine, monkeypatch: pytest.MonkeyPatch, effect: Callable[[], None] | None = None
                              ) -> tuple[threading.Event, threading.Event]:
    """The scheduler's first forward waits for ``go`` (``entered`` says it started), then runs ``effect`` (which may
    raise) or the real forward."""
    real, entered, go, calls = eng.runner.forward, threading.Event(), threading.Event(), []

    def forward(batch: Any) -> Any:
        if threading.current_thread().name == "bcg-scheduler" and not calls:
            calls.append(1)
            entered.set()
            assert go.wait(HANG_S)
            if effect is not None:
                effect()
        return real(batch)

    monkeypatch.setattr(eng.runner, "forward", forward)
    return entered, go
