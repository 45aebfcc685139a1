"""The host as a variable: running a block of work pinned to fewer CPU cores (the seed's CPU-starvation experiment).

:func:`pinned` restricts every thread of the process to the first ``n`` cores it may run on (Linux CPU affinity)
and sets torch's intra-op threads to ``n``, then puts both back as they were; threads started while pinned get the
process's original cores back too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["available_cores", "check_cores", "pinned"]


def available_cores() -> list[int]:
    """The CPU cores this process may run on (empty where the platform cannot say)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def check_cores(counts: list[int]) -> None:
    """Refuses core counts this process cannot be pinned to, naming the cores it has; raises ValueError.

    Example::

        check_cores([1, 2])        # fine on a machine whose process may use two or more cores
        check_cores([64])          # ValueError: --cpu-cores: 64 cores asked, but this process may run on 2 ...
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpu-cores needs CPU affinity (os.sched_setaffinity), which this platform does not have; "
                         "leave --cpu-cores out")
    cores = available_cores()
    bad = [n for n in counts if not 1 <= n <= len(cores)]
    if bad:
        raise ValueError(f"--cpu-cores: {bad[0]} cores asked, but this process may run on {len(cores)} "
                         f"(cores {_ranges(cores)}); give counts from 1 to {len(cores)}")


def _ranges(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores) if len(cores) <= 8 else f"{cores[0]}-{cores[-1]}"


def _threads() -> list[int]:
    tasks = Path("/proc/self/task")
    return [int(p.name) for p in tasks.iterdir()] if tasks.is_dir() else [0]


def _set(tid: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cores)
    except (ProcessLookupError, PermissionError):  # the thread ended meanwhile, or is not ours to move
        pass


@contextmanager
def pinned(num_cores: int | None) -> Iterator[list[int]]:
    """Runs the block on the first ``num_cores`` cores with as many torch threads (``None``: as the process is);
    yields the cores used. Everything is restored on exit, also after an exception.

    Example::

        with pinned(2) as cores:
            host = host_times(eng, prompt, runs=20, warmup=5)    # the launch path on two cores
    """
    if num_cores is None:
        yield available_cores()
        return
    check_cores([num_cores])
    original = set(os.sched_getaffinity(0))
    chosen = set(sorted(original)[:num_cores])
    saved = {tid: os.sched_getaffinity(tid) for tid in _threads()}
    threads = torch.get_num_threads()
    try:
        for tid in saved:
            _set(tid, chosen)
        torch.set_num_threads(num_cores)
        yield sorted(chosen)
    finally:
        torch.set_num_threads(threads)
        for tid in _threads():
            _set(tid, saved.get(tid, original))
