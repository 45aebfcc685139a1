"""Chunked prefill scheduling: split prompts into chunks and pack chunks of different requests into batches."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Chunk", "plan_batches"]


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of request ``request`` (``start`` of them already cached); ``is_last`` ends it.

    A named tuple, not a dataclass: one is built per request per prefill on the host's critical path.
    """

    request: int
    start: int
    end: int
    is_last: bool


def plan_batches(lengths: list[int], chunked_prefill_size: int) -> list[list[Chunk]]:
    """Packs requests first-come first-served into batches of at most ``chunked_prefill_size`` tokens.

    A prompt longer than the budget is split; its later chunks land in later batches and attend to the cached
    prefix. Each request appears at most once per batch, so a chunk's prefix is always complete.

    Example::

        >>> [[(c.request, c.start, c.end) for c in b] for b in plan_batches([3, 6], 4)]
        [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)], [(1, 5, 6)]]
    """
    if sum(lengths) <= chunked_prefill_size:  # the common case: every prompt whole, in one batch
        return [[Chunk(i, 0, n, True) for i, n in enumerate(lengths)]]
    done = [0] * len(lengths)
    batches: list[list[Chunk]] = []
    while any(d < n for d, n in zip(done, lengths)):
        budget, batch = chunked_prefill_size, []
        for i, n in enumerate(lengths):
            take = min(n - done[i], budget)
            if take <= 0:
                continue
            batch.append(Chunk(i, done[i], done[i] + take, done[i] + take == n))
            done[i] += take
            budget -= take
            if budget == 0:
                break
        batches.append(batch)
    return batches
