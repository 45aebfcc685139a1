"""The engine's KV slots: how many the pool holds, and how one prefill leases them.

The pool is sized like a serving engine's (:func:`default_kv_tokens`): a share of the free device memory on CUDA,
the model's context length plus one chunk on the CPU, never less than the largest bucket (capture runs a dummy batch
of that size). A prefill then holds no more than it needs at any one time: :class:`SlotLease` reserves, all at once,
the most slots the prefill's batches hold together (:func:`slots_held`), hands each chunk its slots as it runs, takes
a request's slots back as soon as its last chunk ran and returns what no later batch needs to the pool. A long prompt
chunked through therefore needs its own length plus what the other requests in flight hold, and a prefill either
gets its whole peak up front or nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bcg.ops.kv_cache import KVPool
from bcg.runtime.scheduler import Chunk

__all__ = ["SlotLease", "default_kv_tokens", "make_kv_pool", "slots_held"]


def _available_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # not Linux: no bound from the host
        return None


def default_kv_tokens(per_token: int, context_length: int, chunked_prefill_size: int, min_tokens: int,
                      device: torch.device, memory_fraction: float) -> int:
    """The pool size when the user gives no ``kv_tokens``, for a pool that takes ``per_token`` bytes a token
    (:attr:`bcg.ops.kv_cache.KVPool.bytes_per_token`).

    CUDA: ``memory_fraction`` of the free device memory (measured now: after the model is loaded, before capture),
    as serving engines size theirs. CPU: one prompt of ``context_length`` tokens plus one chunk of others in flight,
    bounded by a quarter of the available host memory. Never below ``min_tokens`` (the largest bucket).

    Example::

        >>> default_kv_tokens(1024, 4096, 2048, 2048, torch.device("cpu"), 0.5)
        6144
    """
    if device.type == "cuda":
        tokens = int(memory_fraction * torch.cuda.mem_get_info(device)[0]) // per_token
    else:
        tokens = (context_length or chunked_prefill_size) + chunked_prefill_size
        available = _available_host_bytes()
        if available is not None:
            tokens = min(tokens, available // 4 // per_token)
    return max(tokens, min_tokens)


def make_kv_pool(model: Any, kv_tokens: int, per_token: int, device: torch.device, dtype: torch.dtype) -> KVPool:
    """``model``'s KV pool of ``kv_tokens`` slots, or a ValueError naming ``kv_tokens`` when the memory is not there
    (checked before allocating on the CPU, where an oversized allocation would not fail cleanly, and on CUDA from
    the allocator's own refusal)."""
    need = kv_tokens * per_token
    available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_host_bytes()

    def refuse() -> ValueError:
        have = f"{available / 2**30:.1f} GiB free" if available is not None else "not that much free"
        return ValueError(f"kv_tokens={kv_tokens} needs {need / 2**30:.1f} GiB of memory for the KV pool "
                          f"({per_token} bytes a token) and the {device.type} has {have}; lower kv_tokens (or leave "
                          "it unset to size the pool from free memory)")

    if available is not None and need > available:
        raise refuse()
    try:
        return model.make_kv_pool(kv_tokens, device, dtype)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, torch.OutOfMemoryError):
            raise
        raise refuse() from e


def slots_held(plan: Sequence[Sequence[Chunk]]) -> list[int]:
    """Slots the requests in flight hold while each batch of ``plan`` runs (a chunk's request holds one slot per
    token up to the chunk's end; a request gives its slots back after its last chunk).

    Example::

        >>> from bcg.runtime.scheduler import plan_batches
        >>> slots_held(plan_batches([90, 30, 30], 32))  # the long prompt's slots come back after its third batch
        [32, 64, 96, 38, 30]
    """
    held, taken, out = 0, {}, []
    for batch in plan:
        for c in batch:
            held += c.end - taken.get(c.request, 0)
            taken[c.request] = c.end
        out.append(held)
        for c in batch:
            if c.is_last:
                held -= taken.pop(c.request)
    return out


class SlotLease:
    """The KV slots of one prefill: reserved at once, handed to chunks, recycled as requests finish.

    Args:
        pool: the KV pool.
        plan: the prefill's batches (:func:`bcg.runtime.scheduler.plan_batches`).
        on_free: called after slots went back to the pool (the engine wakes prefills waiting for slots).
        alloc: takes slots of ``pool`` (default ``pool.alloc``; the engine's prefix cache evicts for a shortfall).

    Call :meth:`reserve` once, then per batch :meth:`take` for each chunk and :meth:`finish` after it ran, and
    :meth:`release` on every exit path (it returns whatever is still held, and may be called again).

    Example::

        >>> pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> from bcg.runtime.scheduler import plan_batches
        >>> plan = plan_batches([6, 2], 4)
        >>> lease = SlotLease(pool, plan)
        >>> lease.peak, lease.reserve(), pool.num_free
        (8, None, 0)
        >>> new, prefix = lease.take(plan[0][0])
        >>> new.tolist(), prefix.tolist()
        ([0, 1, 2, 3], [])
        >>> lease.finish(0); lease.release(), pool.num_free
        (True, 8)
    """

    def __init__(self, pool: KVPool, plan: Sequence[Sequence[Chunk]], on_free: Callable[[], None] | None = None,
                 alloc: Callable[[int], Tensor] | None = None) -> None:
        self.pool, self.plan, self.on_free = pool, plan, on_free
        self._alloc = alloc or pool.alloc
        held = slots_held(plan)
        self.peak = max(held)
        # After batch b the lease keeps what any later batch holds: the suffix maximum of ``held``.
        self._keep = [0] * len(held)
        for b in range(len(held) - 2, -1, -1):
            self._keep[b] = max(held[b + 1], self._keep[b + 1])
        self._free = np.empty(0, dtype=np.int64)  # reserved, not lent: a stack whose top is self._top
        self._top = 0
        self._lent: dict[int, list[Tensor]] = {}  # request -> the slots of its chunks so far
        self._num_lent = 0
        self.is_reserved = False

    def reserve(self) -> None:
        """Takes the prefill's peak from the pool at once.

        Raises:
            KVPoolFullError: the pool has fewer free slots; nothing is reserved.
        """
        self._free = self._alloc(self.peak).numpy()[::-1].copy()
        self._top, self.is_reserved = self.peak, True

    def take(self, chunk: Chunk) -> tuple[Tensor, Tensor]:
        """Slots for ``chunk``'s new tokens, and those already holding its request's prefix (in position order)."""
        n = chunk.end - chunk.start
        new = torch.from_numpy(self._free[self._top - n : self._top][::-1].copy())
        self._top -= n
        self._num_lent += n
        mine = self._lent.setdefault(chunk.request, [])
        prefix = mine[0] if len(mine) == 1 else torch.cat(mine) if mine else new[:0]
        mine.append(new)
        return new, prefix

    def finish(self, index: int) -> None:
        """Batch ``index`` ran: its finished requests' slots come back, and what no later batch needs goes back to
        the pool (the highest slots first, so the pool keeps handing out its lowest ones first)."""
        for c in self.plan[index]:
            if c.is_last:
                self._push(self._lent.pop(c.request))
        surplus = self._top + self._num_lent - self._keep[index]
        if surplus <= 0:
            return
        region = self._free[: self._top]
        if surplus < self._top:
            region.sort()
            back = region[self._top - surplus :].copy()
            self._top -= surplus
            self._free[: self._top] = region[: self._top][::-1].copy()  # lowest on top: handed out first
            self._give_back(back)
        else:
            self._top = 0
            self._give_back(region.copy())

    def release(self) -> bool:
        """Returns every slot still held to the pool (on success and on any failure); True if a reservation
        ended here, False if there was none (never reserved, or already released)."""
        was_reserved, self.is_reserved = self.is_reserved, False
        parts = [self._free[: self._top]] + [t.numpy() for ts in self._lent.values() for t in ts]
        self._top, self._lent, self._num_lent = 0, {}, 0
        self._give_back(np.concatenate(parts))
        return was_reserved

    def _push(self, slots: list[Tensor]) -> None:
        for t in slots:
            n = t.numel()
            self._free[self._top : self._top + n] = t.numpy()
            self._top += n
            self._num_lent -= n

    def _give_back(self, slots: np.ndarray) -> None:
        if slots.size:
            if slots.size > 1 and not bool((slots[1:] > slots[:-1]).all()):
                slots = np.sort(slots)  # ascending: the pool then hands the lowest out first again
            self.pool.free(torch.from_numpy(slots), check=False)  # handed out by this pool: sorted, distinct
            if self.on_free is not None:
                self.on_free()
