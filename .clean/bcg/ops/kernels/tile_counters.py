"""The tile counters of bcg's split-K kernels (:mod:`bcg.ops.kernels.down_proj`, :mod:`bcg.ops.kernels.qkv_rope`).

A split-K kernel's programs each add their partial sums of an output tile to a workspace and count themselves in
on the tile's counter; the last one sums the partials and resets the counter to zero for the next launch. The
counters are one int32 buffer per device, zero between launches, shared by every such kernel (they run one after
another on a stream, each leaving them zero). A captured graph holds their address, so a buffer outgrown is kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tile_counters"]

_COUNTERS: dict[torch.device, Tensor] = {}
_OUTGROWN: list[Tensor] = []


def tile_counters(device: torch.device, tiles: int, kernel: str) -> Tensor:
    """The device's tile counters, at least ``tiles`` of them (made, or grown, outside a graph capture only: a
    capture would record the zeroing and replay it; ``kernel`` names the caller in that error).

    Example::

        counters = tile_counters(x.device, plan.tiles, "swiglu_down")
    """
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{kernel} needs {tiles} tile counters on {device} and has "
                f"{0 if counters is None else counters.numel()}: they are made on the first eager call, so run the "
                "forward once outside the capture (a warm-up) with the largest batch the graph will hold")
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(4096, tiles), dtype=torch.int32, device=device)
    return counters
