"""Test helper: the ranks of a CPU tensor parallel group as child processes, kept alive across a module's tests.

Each rank gets the ``torchrun`` environment (``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), so the first ``Engine(..., tp_size=N)`` in it creates the gloo process group exactly
as under ``torchrun``. :meth:`RankPool.run` sends one function to every rank and returns their results in rank
order; a rank that raises fails the test with its traceback, and ranks that do not answer within the timeout fail it
as a hang (the pool is then torn down), so a deadlock can never stall the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)  # a few ranks share a couple of cores
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # reported to the test with the traceback
            results.put((rank, False, traceback.format_exc()))


class RankPool:
    """``world_size`` rank processes; ``run(fn, *args)`` calls ``fn(*args)`` on every rank (``fn`` importable).

    Results travel by pickle: return plain values or numpy arrays.

    Example::

        pool = RankPool(2)
        logits = pool.run(prefill_on_rank, "tiny-dense")   # [rank 0's, rank 1's]
        pool.close()
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, start_method: str | None = None) -> None:
        # Forked from the test process (which holds no process group and no CUDA context) by default: starting a
        # rank costs nothing, where a spawned one re-imports torch (seconds each on a loaded CI machine). CUDA
        # ranks must be spawned.
        default = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(start_method or default)
        self.world_size, self.timeout_s = world_size, timeout_s
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            allow_exit: frozenset[int] | set[int] = frozenset()) -> list[Any]:
        """``fn(*args)`` on every rank; ranks in ``allow_exit`` may exit instead of answering (their result: None)."""
        for q in self._tasks:
            q.put((fn, args))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        answers: dict[int, tuple[bool, Any]] = {}
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                answers[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answers]
            for r in [r for r in dead if r in allow_exit]:
                answers[r] = (True, None)
            dead = [r for r in dead if r not in allow_exit]
            if dead or time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in answers]
                self.close()
                why = f"died (exit codes {[self._procs[r].exitcode for r in dead]})" if dead else "hung"
                raise AssertionError(f"{fn.__name__}: ranks {missing} {why}; answers so far: {answers}")
        errors = {r: v for r, (ok, v) in answers.items() if not ok}
        if errors:
            raise AssertionError(f"{fn.__name__} raised on rank(s) {sorted(errors)}:\n" +
                                 "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [answers[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def module_pool(world_size: int, timeout_s: float = 120.0) -> Any:
    """A module-scoped fixture named ``pool``: ``pool = module_pool(2)`` at the top of a test module gives its tests
    one :class:`RankPool`, started for the first of them and closed after the last."""

    @pytest.fixture(scope="module")
    def pool() -> Iterator[RankPool]:
        ranks = RankPool(world_size, timeout_s=timeout_s)
        yield ranks
        ranks.close()

    return pool
