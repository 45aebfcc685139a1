"""The order in which waiting requests are admitted (``EngineConfig.schedule_policy``).

- ``"fifo"`` (the default): first come, first served. The head of the queue is admitted first, and when it cannot get
  its KV slots nobody behind it is admitted either, so no request is overtaken and none starves.
- ``"shortest"``: the shortest prompt first (ties in arrival order). Short requests no longer wait behind long ones,
  which lowers the median time to first token under load; the price is that under sustained overload a long prompt
  waits for as long as shorter ones keep arriving. For workloads of mixed lengths whose p50 matters more than their
  p100.

Requests already running (a chunked prompt part-way through) are not queued here: the scheduler continues them first.
"""

from __future__ import annotations

import heapq
from collections import deque

from bcg.runtime.serving.request import Request

__all__ = ["POLICIES", "FifoQueue", "ShortestFirstQueue", "make_queue"]


class FifoQueue:
    """Waiting requests in arrival order.

    Example:
        >>> q = FifoQueue(); q.push("a"); q.push("b")
        >>> q.peek(), q.pop(), len(q)
        ('a', 'a', 1)
    """

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._items.append(request)

    def peek(self) -> Request | None:
        """The request to admit next (None when empty)."""
        return self._items[0] if self._items else None

    def pop(self) -> Request:
        return self._items.popleft()

    def drain(self) -> list[Request]:
        """Every waiting request, removed."""
        items, self._items = list(self._items), deque()
        return items

    def __len__(self) -> int:
        return len(self._items)


class ShortestFirstQueue(FifoQueue):
    """Waiting requests shortest prompt first, ties in arrival order.

    Example:
        >>> import torch
        >>> from concurrent.futures import Future
        >>> q = ShortestFirstQueue()
        >>> for seq, n in enumerate([5, 2, 9, 2]):
        ...     q.push(Request(torch.zeros(n, dtype=torch.long), Future(), seq=seq))
        >>> [(r.num_tokens, r.seq) for r in (q.pop(), q.pop(), q.pop())]
        [(2, 1), (2, 3), (5, 0)]
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.num_tokens, request.seq, request))

    def peek(self) -> Request | None:
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def drain(self) -> list[Request]:
        items, self._heap = [r for _, _, r in sorted(self._heap)], []
        return items

    def __len__(self) -> int:
        return len(self._heap)


POLICIES = {"fifo": FifoQueue, "shortest": ShortestFirstQueue}


def make_queue(policy: str) -> FifoQueue:
    """The waiting queue of ``policy`` (one of :data:`POLICIES`)."""
    return POLICIES[policy]()
