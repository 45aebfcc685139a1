"""One served request: its result (what :meth:`Engine.submit <bcg.runtime.engine.Engine.submit>`'s future holds), and
the state the scheduler keeps for it while it waits and runs."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from bcg.runtime.runner.telemetry import BatchRecord

__all__ = ["EngineClosedError", "Request", "RequestResult"]


class EngineClosedError(RuntimeError):
    """The engine was closed (:meth:`Engine.close <bcg.runtime.engine.Engine.close>`) before this request ran, or a
    request was submitted to a closed engine."""


@dataclass
class RequestResult:
    """The result of one submitted prompt.

    Attributes:
        logits: ``(1, vocab)`` fp32 logits at the prompt's last token (on the engine's device).
        next_tokens: ``(1,)`` the greedy first output token (on the engine's device).
        batches: the record of every forward the request's chunks ran in (bucket replayed, or why eagerly).
        cached_tokens: tokens of the prompt whose KV came from the prefix cache (not computed for this request).
        num_tokens: the prompt's length.
        queue_ms: from :meth:`~bcg.runtime.engine.Engine.submit` until the first forward holding it was launched.
        ttft_ms: from :meth:`~bcg.runtime.engine.Engine.submit` until its logits were on the device (time to first
            token).
        completed_at: when that was, on the :func:`time.perf_counter` clock (a load generator times from its own
            schedule with it, with no done-callback in the measurement).
    """

    logits: Tensor
    next_tokens: Tensor
    batches: list[BatchRecord]
    cached_tokens: int
    num_tokens: int
    queue_ms: float
    ttft_ms: float
    completed_at: float = 0.0


@dataclass(eq=False)
class Request:
    """The planner's state of one request (owned by the thread that plans: the scheduler's, or a prefill's caller).

    ``slots`` holds one pool slot per prompt token once admitted: ``slots[:cached]`` are the prefix cache's (read,
    never freed by the request), the rest the request's own until the cache adopts them (``adopted``).
    """

    ids: Tensor  # CPU int64, validated
    future: Future | None  # None: one prompt of a prefill() call, which the caller's thread runs to its end
    arrival: float = field(default_factory=time.perf_counter)
    seq: int = 0  # order of arrival
    cached: int = 0
    done: int = 0  # tokens whose KV is cached or launched: the next chunk starts here
    slots: np.ndarray | None = None
    adopted: np.ndarray | None = None  # per position: the prefix cache owns the slot now
    node: object | None = None  # the prefix-cache node the request locks
    batches: list[BatchRecord] = field(default_factory=list)
    first_launch: float | None = None

    def __post_init__(self) -> None:
        self.tokens = self.ids.numpy()
        self.num_tokens = len(self.tokens)

    @property
    def remaining(self) -> int:
        """Tokens still to run."""
        return self.num_tokens - self.done

    def own_slots(self) -> np.ndarray:
        """The slots the request must give back to the pool when it ends: its own, not adopted by the cache."""
        assert self.slots is not None
        own = self.slots[self.cached :]
        return own if self.adopted is None else own[~self.adopted[self.cached :]]

    def result(self, logits: Tensor, next_tokens: Tensor, completed: float) -> RequestResult:
        launched = self.first_launch if self.first_launch is not None else completed
        return RequestResult(logits, next_tokens, self.batches, self.cached, self.num_tokens,
                             (launched - self.arrival) * 1e3, (completed - self.arrival) * 1e3, completed)
