"""torch's profiler without its native start/stop lines on stderr: ``bcg analyze`` profiles dozens of forwards, and
each start and stop of the native profiler writes a ``USDT: ... profiler_start`` line of its own logging to file
descriptor 2, which no setting turns off. :func:`quiet_profile` runs the start and the stop with the descriptor
caught and passes on everything else written meanwhile.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["quiet_profile"]

# Words of the native line ("USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start").
_NATIVE_NOISE = ("USDT:", "] profiler_st")


@contextmanager
def _stderr_without_noise() -> Iterator[None]:
    """Runs the block with file descriptor 2 into a temporary file, then passes on every line it got except the
    profiler's start/stop lines (native code writes to the descriptor, not to ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not all(w in line for w in _NATIVE_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[Any]:
    """``torch.profiler.profile(**kwargs)`` as a block, without the two lines the native profiler writes to stderr at
    its start and stop (anything else written then still shows).

    Example::

        with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x)
        prof.events()
    """
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _stderr_without_noise():
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_without_noise():
            prof.stop()
