"""Tensor parallel: which rank this process is, its process groups, and the collectives the models call.

A :class:`TensorParallel` is handed to the model at construction; its layers shard their weights by ``rank`` and
``size`` and reduce partial results with :meth:`TensorParallel.all_reduce`, which runs inside graph segments (NCCL
collectives are capturable; the CPU emulation records them and replays them over gloo). At ``size == 1`` nothing in
this module runs: no process group is needed and the models build the plain single-device layers.

Two process groups, both spanning every rank: ``group`` carries the model's collectives (NCCL on CUDA, gloo on a CPU)
and ``host_group`` (always gloo) carries the runner's small cross-rank agreements, so agreeing on a bucket never
waits for the device. :func:`init_tensor_parallel` creates them from the ``torchrun`` environment when no process
group exists yet, with a bounded timeout: a rank that dies or hangs makes the others raise
:class:`TensorParallelError` instead of waiting forever.
"""

from __future__ import annotations

import datetime
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from bcg import env
from bcg.errors import first_line
from bcg.islands import eager_on_graph

__all__ = ["SINGLE", "TensorParallel", "TensorParallelError", "init_tensor_parallel", "kv_head_range",
           "shutdown_tensor_parallel"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Debug switch: run every all-reduce as an eager island (a break) instead of inside the graph segments, for a
# transport whose collectives are not capture-safe. Breakable graphs then replay them eagerly between segments.
_AS_ISLAND = env.TP_ALLREDUCE_ISLAND
# The gloo group for host-side agreement, one per process (new_group is collective: every rank creates it once).
_host_groups: dict[tuple[int, ...], Any] = {}


class TensorParallelError(RuntimeError):
    """A tensor parallel run cannot go on: bad launch, or a rank died, hangs or took a different path."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor parallel group.

    Attributes:
        size: ranks sharing each layer (1: no tensor parallel, no process group).
        rank: this process's rank in ``[0, size)``.
        group: process group of the model's collectives (NCCL on CUDA, gloo on a CPU); None at size 1.
        host_group: gloo group of the runner's agreements (host tensors only); None at size 1.
        timeout_s: how long any collective waits for the other ranks before raising.

    Example:
        >>> SINGLE.is_parallel, SINGLE.shard(12)
        (False, (0, 12))
        >>> TensorParallel(size=4, rank=1).shard(12)
        (3, 6)
    """

    size: int = 1
    rank: int = 0
    group: Any = None
    host_group: Any = None
    timeout_s: float = 600.0

    @property
    def is_parallel(self) -> bool:
        """More than one rank: the layers are sharded and reduce across ranks."""
        return self.size > 1

    def shard(self, n: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's share of ``n`` items split evenly (``n`` divisible by ``size``)."""
        if n % self.size:
            raise ValueError(f"{n} items cannot be split evenly over {self.size} tensor parallel ranks")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sums ``x`` over the ranks in place and returns it (a collective inside graph segments).

        Raises:
            TensorParallelError: a peer died or did not join within ``timeout_s`` (eager runs; inside a graph
                the replay reports it).
        """
        try:
            (_all_reduce_island if _AS_ISLAND else _all_reduce)(x, self.group)
        except RuntimeError as e:
            raise self.peer_error("an all-reduce of the model", e) from e
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (eager use: the LM head's vocabulary)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        except RuntimeError as e:
            raise self.peer_error("an all-gather of the model", e) from e
        return torch.cat(parts, dim=dim)

    def peer_error(self, what: str, cause: BaseException) -> TensorParallelError:
        """The error for a collective that failed: names this rank, the step and the way out."""
        return TensorParallelError(
            f"tensor parallel rank {self.rank}/{self.size}: {what} failed ({first_line(cause)}). Another rank died, "
            f"hangs past the {self.timeout_s:g} s timeout (EngineConfig.tp_timeout_s) or took a different path; the "
            "group cannot continue: stop every rank and relaunch (torchrun restarts the whole group).")


SINGLE = TensorParallel()


def _all_reduce(x: Tensor, group: Any) -> None:
    dist.all_reduce(x, group=group)


_all_reduce_island = eager_on_graph(_all_reduce)


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads this rank holds.

    With at least as many KV heads as ranks they are split evenly; with fewer, each KV head is replicated on
    ``size // num_kv_heads`` consecutive ranks, which hold exactly the query heads that share it.

    Example:
        >>> kv_head_range(8, TensorParallel(size=4, rank=1)), kv_head_range(2, TensorParallel(size=8, rank=5))
        ((2, 4), (1, 2))
    """
    if num_kv_heads >= tp.size:
        return tp.shard(num_kv_heads)
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp.size} ranks")
    head = tp.rank // (tp.size // num_kv_heads)
    return head, head + 1


def init_tensor_parallel(size: int, device: torch.device, timeout_s: float = 600.0) -> TensorParallel:
    """This process's :class:`TensorParallel` for ``size`` ranks; at ``size == 1`` :data:`SINGLE`, touching nothing.

    Uses the default process group when one exists (it must span exactly ``size`` ranks); otherwise initialises it
    from the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
    ``LOCAL_RANK`` for the GPU): NCCL on CUDA, gloo on a CPU, with ``timeout_s``. On CUDA a device without an index
    becomes ``cuda:LOCAL_RANK`` (``torch.cuda.set_device``).

    Raises:
        TensorParallelError: no process group and no ``torchrun`` environment (the message says how to launch), or
            a group of another size.

    Example::

        tp = init_tensor_parallel(2, torch.device("cuda"))   # inside `torchrun --nproc-per-node 2 ...`
        tp.rank, tp.size                                     # (0, 2) on the first process
    """
    if size == 1:
        return SINGLE
    if size < 1:
        raise ValueError(f"tp_size must be >= 1, got {size}")
    if not dist.is_available():
        raise TensorParallelError("tp_size > 1 needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        missing = [v for v in _ENV if v not in os.environ]
        if missing:
            raise TensorParallelError(
                f"tp_size={size} runs one process per rank, but no process group exists and {', '.join(missing)} "
                f"is not set. Launch with `torchrun --nproc-per-node {size} -m bcg bench --tp {size} ...` (or your "
                "script under torchrun), or call torch.distributed.init_process_group before building the engine.")
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            local = torch.device("cuda", device.index if device.index is not None
                                 else int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
            torch.cuda.set_device(local)
            if "device_id" in inspect.signature(dist.init_process_group).parameters:
                kwargs["device_id"] = local  # eager NCCL init: the communicator exists before any capture
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kwargs)
    world = dist.get_world_size()
    if world != size:
        raise TensorParallelError(f"tp_size={size}, but the process group has {world} ranks; tensor parallel spans "
                                  f"the whole group: launch with --nproc-per-node {size}")
    ranks = tuple(range(world))
    if ranks not in _host_groups:
        _host_groups[ranks] = dist.new_group(list(ranks), backend="gloo",
                                             timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallel(size, dist.get_rank(), dist.group.WORLD, _host_groups[ranks], timeout_s)


def shutdown_tensor_parallel() -> None:
    """Destroys the process groups (the default one included), e.g. at the end of a ``torchrun`` worker."""
    if dist.is_available() and dist.is_initialized():
        _host_groups.clear()
        dist.destroy_process_group()
