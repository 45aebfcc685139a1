"""Running a call on its own thread, and waiting for it or for a condition no longer than ``HANG_S``, for tests that
must tell a hang from an answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

HANG_S = 30.0  # longer than any answer takes on a loaded CI machine: past it, a wait has hung


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Starts ``fn`` on a daemon thread; the dict gets its ``result`` or ``error``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def finishes(thread: threading.Thread, what: str) -> None:
    """``thread`` ends within ``HANG_S``, or the test fails naming ``what`` hung."""
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{what} hung"


def wait_for(predicate: Callable[[], bool], what: str = "condition") -> None:
    """Polls ``predicate`` until it holds, failing the test after ``HANG_S``."""
    end = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)
