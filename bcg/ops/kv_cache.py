"""Token-slot KV pool (page size 1) with a host-side slot allocator.

Every token of every request owns one slot, the same slot index in every layer. Slot
``num_slots`` (the last row) is a scratch slot owned by nobody: a backend that cannot mask the
KV write of padded rows (a whole-graph capture) can point them there. The bcg islands never write
padded rows at all. :func:`run_starts` tells which requests' slots are one ascending run (a kernel can then read
their keys by address).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor


class KVShape(Protocol):
    """The model dimensions a pool is sized by (a :class:`bcg.models.config.ModelConfig` has them)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_index_groups: int
    index_head_dim: int


class KVPoolFullError(RuntimeError):
    """Not enough free slots for an allocation."""


class KVPool:
    """Per-layer K/V caches (plus per-group index-key caches for DSA) and a slot allocator.

    Shapes: ``k[layer]`` and ``v[layer]`` are ``(num_slots + 1, num_kv_heads, head_dim)``;
    ``index_k[group]`` is ``(num_slots + 1, index_head_dim)``. All start zeroed. ``buffers[layer]`` names every
    per-layer cache of a layer (``{"k": k[layer], "v": v[layer]}`` here; any names and per-token shapes in a pool
    made by :meth:`for_layers`).

    Slot bookkeeping stays on the host: :meth:`alloc` returns a CPU ``int64`` tensor and
    :meth:`free` takes one; :class:`bcg.runtime.batch.PrefillBatch` ships slots to the device in
    one copy per batch. Both are thread-safe (one lock around the bookkeeping).

    Example:
        >>> pool = KVPool(num_slots=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        >>> slots = pool.alloc(3)
        >>> slots.tolist(), pool.num_free
        ([0, 1, 2], 1)
        >>> pool.free(slots); pool.num_free
        4
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_index_groups: int = 0,
        index_head_dim: int = 0,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.index_k = [
            torch.zeros(num_slots + 1, index_head_dim, dtype=dtype, device=self.device) for _ in range(num_index_groups)
        ]
        self.buffers: list[dict[str, Tensor]] = [{"k": k, "v": v} for k, v in zip(self.k, self.v)]
        # Host bookkeeping in numpy: cheap per call on the prefill's critical path, and untouched by inference mode
        # (a pool built under torch.inference_mode() must still free slots outside it). Free slots form a stack,
        # reversed so allocations come out in ascending order.
        self._free_stack = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._num_free = num_slots
        self._is_free = np.ones(num_slots, dtype=bool)
        self._lock = threading.Lock()

    @classmethod
    def for_model(
        cls, config: KVShape, num_slots: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVPool:
        """Pool sized for ``config`` with a budget of ``num_slots`` cached tokens.

        Example:
            >>> from types import SimpleNamespace
            >>> shape = SimpleNamespace(num_layers=5, num_kv_heads=2, head_dim=16, num_index_groups=2,
            ...                         index_head_dim=16)
            >>> len(KVPool.for_model(shape, 16, "cpu", torch.float32).index_k)
            2
        """
        return cls(
            num_slots, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device,
            num_index_groups=config.num_index_groups, index_head_dim=config.index_head_dim,
        )

    @classmethod
    def for_layers(
        cls, layer_shapes: Sequence[Mapping[str, tuple[int, ...]]], num_slots: int, device: torch.device | str,
        dtype: torch.dtype,
    ) -> KVPool:
        """Pool whose layer ``l`` holds one ``(num_slots + 1, *shape)`` buffer per entry ``name: shape`` of
        ``layer_shapes[l]``, for models whose layers cache different things (MLA latents, an indexer's keys);
        ``k``/``v`` are the buffers named so (None in a layer without one).

        Example:
            >>> pool = KVPool.for_layers([{"k": (2, 16), "v": (2, 12)}, {"k": (1, 8), "index": (4,)}], 8, "cpu",
            ...                          torch.float32)
            >>> pool.v[0].shape, pool.v[1], pool.buffers[1]["index"].shape
            (torch.Size([9, 2, 12]), None, torch.Size([9, 4]))
        """
        pool = cls(num_slots, 0, 1, 1, dtype, device)
        pool.buffers = [{name: torch.zeros((num_slots + 1, *shape), dtype=dtype, device=pool.device)
                         for name, shape in spec.items()} for spec in layer_shapes]
        pool.k = [b.get("k") for b in pool.buffers]
        pool.v = [b.get("v") for b in pool.buffers]
        return pool

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes across every layer's buffers and the index-key caches.

        Example:
            >>> KVPool(4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32).bytes_per_token
            256
        """
        tensors = [t for spec in self.buffers for t in spec.values()] + list(self.index_k)
        return sum(t[0].numel() * t.element_size() for t in tensors)

    @property
    def scratch_slot(self) -> int:
        """Index of the scratch slot that padded rows may write to."""
        return self.num_slots

    @property
    def num_free(self) -> int:
        """Slots currently free."""
        return self._num_free

    def alloc(self, n: int) -> Tensor:
        """Take ``n`` free slots; returns a CPU ``int64`` tensor of slot indices.

        The pool knows nothing of who caches what: a caller that can free slots (the prefix cache, which evicts
        for a shortfall) does so before it calls this.

        Raises:
            KVPoolFullError: fewer than ``n`` slots are free; nothing is allocated.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        with self._lock:
            if n > self._num_free:
                raise KVPoolFullError(
                    f"KV pool out of slots: requested {n}, only {self._num_free} of {self.num_slots} free "
                    f"(short by {n - self._num_free})"
                )
            return self._take(n)

    def _take(self, n: int) -> Tensor:
        start = self._num_free - n
        slots = self._free_stack[start : self._num_free][::-1].copy()
        self._num_free = start
        self._is_free[slots] = False
        return torch.from_numpy(slots)

    def free(self, slots: Tensor, check: bool = True) -> None:
        """Return ``slots`` to the pool (their cached contents become garbage).

        ``check=False`` skips the range and duplicate checks, for a caller returning slots it was handed by
        :meth:`alloc` (the engine's lease); an allocated-twice check stays.

        Raises:
            ValueError: a slot is out of range, duplicated, or not allocated; nothing is freed.
        """
        slots = slots.detach().to("cpu", torch.int64).flatten()
        if slots.numel() == 0:
            return
        idx = slots.numpy()
        if check:
            if int(idx.min()) < 0 or int(idx.max()) >= self.num_slots:
                raise ValueError(f"slot out of range [0, {self.num_slots}) in free()")
            if np.unique(idx).size != idx.size:
                raise ValueError("free() got a duplicated slot or one that is not allocated")
        with self._lock:
            if bool(self._is_free[idx].any()):
                raise ValueError("free() got a duplicated slot or one that is not allocated")
            self._is_free[idx] = True
            end = self._num_free + idx.size
            self._free_stack[self._num_free : end] = idx[::-1]
            self._num_free = end


def run_starts(slots: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """Per sequence ``s`` (keys ``slots[cu[s]:cu[s + 1]]``): its first slot where its slots run up by one, else -1
    (also for an empty sequence).

    Staged before every whole-step replay, while the GPU waits: one numpy pass finds the steps other than +1 (none
    for a fresh pool's batch), then a loop over the few sequences asks whether one falls inside each.

    Example:
        >>> run_starts(np.array([7, 8, 9, 3, 5, 5, 6]), np.array([0, 3, 5, 7, 7])).tolist()
        [7, -1, 5, -1]
    """
    bounds = cu.tolist()
    num_keys = bounds[-1]
    # Index i is a break when slots[i + 1] != slots[i] + 1; a sequence [a, b) is a run iff no break in [a, b - 1).
    steps = slots[1:num_keys] - slots[: max(num_keys - 1, 0)]
    breaks = np.flatnonzero(steps != 1).tolist()
    out = [-1] * (len(bounds) - 1)
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start and bisect_left(breaks, start) == bisect_left(breaks, end - 1):
            out[seq] = int(slots[start])
    return np.array(out, dtype=np.int64)
