"""Running a call on its own thread, for tests that must tell a hang from an answer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


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
