"""The engine's KV slots: how many the pool holds, and how one prefill reserves them.

The pool is sized like a serving engine's (:func:`default_kv_tokens`): a share of the free device memory on CUDA,
the model's context length plus one chunk on the CPU, never less than the largest bucket (capture runs a dummy batch
of that size). A prefill then holds no more than it needs at any one time: :class:`SlotReservation` takes, all at
once, the most slots its prompts hold together while the planner packs them first come first served
(:func:`slots_held`), hands each chunk its slots as the planner packs it, takes a prompt's slots back as soon as its
last chunk ran and returns what no later forward needs to the pool. A long prompt chunked through therefore needs
its own length plus what the other prompts in flight hold, and a prefill either gets its whole peak up front or
nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bcg.ops.kv_cache import KVPool

__all__ = ["SlotReservation", "default_kv_tokens", "make_kv_pool", "slots_held"]


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


def slots_held(lengths: Sequence[int], budget: int) -> np.ndarray:
    """Slots the prompts in flight hold during each forward when prompts of ``lengths`` are packed first come first
    served into forwards of ``budget`` tokens (the planner's rule, :class:`~bcg.runtime.serving.batcher.Batcher`):
    a prompt holds one slot per token up to the end of its chunk, and gives them back after its last chunk.

    That packing cuts the prompts' tokens, back to back, into windows of ``budget``, so the answer is arithmetic on
    the windows, with no per-prompt loop: forward ``b`` holds the tokens up to its window's end less those of the
    prompts that ended before its window starts.

    Example::

        >>> slots_held([90, 30, 30], 32).tolist()  # the long prompt's slots come back after the third forward
        [32, 64, 96, 38, 30]
    """
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    total = int(ends[-1])
    if total <= budget:  # the common case: every prompt whole, in one forward
        return np.array([total], dtype=np.int64)
    starts = np.arange(0, total, budget, dtype=np.int64)
    ended = np.concatenate(([0], ends))[np.searchsorted(ends, starts, side="right")]
    return np.minimum(starts + budget, total) - ended


class SlotReservation:
    """The KV slots of one prefill: reserved at once, handed to chunks, recycled as prompts finish.

    Args:
        pool: the KV pool.
        lengths: the prompts' lengths, packed first come first served.
        budget: most tokens a forward holds (``chunked_prefill_size``).
        on_free: called after slots went back to the pool (the engine wakes those waiting for slots).
        alloc: takes slots of ``pool`` (default ``pool.alloc``; the engine's prefix cache evicts for a shortfall).

    Call :meth:`reserve` once, then :meth:`take` for each chunk the planner packs, :meth:`give` for a finished prompt's
    slots and :meth:`finished_forward` after each forward, and :meth:`release` on every exit path (it returns
    whatever is still held, the slots lent to chunks included, and may be called again).

    Example::

        >>> pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        >>> res = SlotReservation(pool, [6, 2], budget=4)
        >>> res.peak, res.reserve(), pool.num_free
        (8, None, 0)
        >>> res.take(4).tolist()
        [0, 1, 2, 3]
        >>> res.finished_forward(); res.release(), pool.num_free
        (True, 8)
    """

    def __init__(self, pool: KVPool, lengths: Sequence[int], budget: int, on_free: Callable[[], None] | None = None,
                 alloc: Callable[[int], Tensor] | None = None) -> None:
        self.pool, self.on_free = pool, on_free
        self._alloc = alloc or pool.alloc
        total = sum(lengths)
        if total <= budget:  # the common case, without numpy: one forward holds every slot, and nothing after it
            self.peak, self._keep = total, [0]
        else:
            held = slots_held(lengths, budget)
            self.peak = int(held.max())
            # After forward b the reservation keeps what any later forward holds: the suffix maximum of ``held``.
            keep = np.zeros_like(held)
            keep[:-1] = np.maximum.accumulate(held[::-1])[::-1][1:]
            self._keep = keep.tolist()
        self._forward = 0
        self._reserved = np.empty(0, dtype=np.int64)
        self._free = self._reserved  # reserved, not lent: a stack whose top is self._top
        self._top = self._num_lent = 0
        self._returned: list[np.ndarray] = []  # given back to the pool before the end
        self.is_reserved = False

    def reserve(self) -> None:
        """Takes the prefill's peak from the pool at once.

        Raises:
            KVPoolFullError: the pool has fewer free slots; nothing is reserved.
        """
        self._reserved = self._alloc(self.peak).numpy()
        self._free = self._reserved[::-1].copy()  # the lowest on top: handed out first
        self._top, self.is_reserved = self.peak, True

    def take(self, n: int) -> np.ndarray:
        """``n`` reserved slots for a chunk's new tokens."""
        if n > self._top:  # the reservation covers the planner's peak: running short is a bug, never a wait
            raise RuntimeError(f"a chunk of {n} tokens found {self._top} reserved slots free (peak {self.peak}): "
                               "the plan does not match slots_held; report this")
        slots = self._free[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._num_lent += n
        return slots

    def give(self, slots: np.ndarray) -> None:
        """A finished prompt's slots come back (for later chunks of this prefill)."""
        n = slots.size
        self._free[self._top : self._top + n] = slots
        self._top += n
        self._num_lent -= n

    def finished_forward(self) -> None:
        """A forward ran (its finished prompts' slots given back): what no later forward needs goes back to the pool
        (the highest slots, so the pool keeps handing out its lowest ones first)."""
        keep = self._keep[self._forward] if self._forward < len(self._keep) else 0
        self._forward += 1
        surplus = self._top + self._num_lent - keep
        if surplus <= 0:
            return
        region = self._free[: self._top]
        if surplus < self._top:
            # The highest go back (linear time, no sort of the whole stack); the order of the rest does not matter.
            region.partition(self._top - surplus)
            back = region[self._top - surplus :].copy()
            self._top -= surplus
        else:
            back, self._top = region.copy(), 0
        self._returned.append(back)
        self._give_back(back)

    def release(self) -> bool:
        """Returns every slot still held to the pool (on success and on any failure, lent ones included); True if a
        reservation ended here, False if there was none (never reserved, or already released)."""
        if not self.is_reserved:
            return False
        self.is_reserved = False
        if self._num_lent == 0:  # every chunk's slots came back: what is held is the free stack
            held = self._free[: self._top]
        else:  # a failure part-way: everything reserved and not yet returned, whoever it was lent to
            held = self._reserved if not self._returned else np.setdiff1d(self._reserved,
                                                                            np.concatenate(self._returned))
        self._top = self._num_lent = 0
        self._give_back(held)
        return True

    def _give_back(self, slots: np.ndarray) -> None:
        if slots.size:
            if slots.size > 1 and not bool((slots[1:] > slots[:-1]).all()):
                slots = np.sort(slots)  # ascending: the pool then hands the lowest out first again
            self.pool.free(torch.from_numpy(slots), check=False)  # handed out by this pool: sorted, distinct
            if self.on_free is not None:
                self.on_free()
