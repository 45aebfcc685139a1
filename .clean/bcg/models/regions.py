"""A layer stack run one layer at a time, through a runner that may compile each layer once (regional compilation).

A model's layer loop calls :func:`run_layer` for each layer with the layer's :class:`~bcg.ops.region_islands.LayerIds`.
Outside :func:`regional` (and while dynamo traces the whole stack, e.g. for ``tc_piecewise``) that is a plain call.
Inside it, the runner installed by ``bcg.runtime.compile`` gets the layer, its ids and its arguments, and calls a
compiled region with ``bcg_region=True`` added to the keyword arguments: layers pass it down to their attention,
which then calls the region islands (:mod:`bcg.ops.region_islands`) instead of baking its layer index into the
trace. Layers of one structure therefore share one compiled graph, whatever their index.

Example::

    for i, layer in enumerate(self.layers):
        hidden, residual = run_layer(layer, LayerIds(attention=i), hidden, residual, rope)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from bcg.ops.context import LayerIds, current_forward_context, forward_state

__all__ = ["REGION_FLAG", "LayerIds", "RegionRunner", "is_regional", "regional", "run_layer"]

REGION_FLAG = "bcg_region"  # the keyword a compiled region adds to a layer's call
RegionRunner = Callable[[nn.Module, LayerIds, tuple, dict], Any]


@contextmanager
def regional(runner: RegionRunner) -> Iterator[None]:
    """Inside the block, :func:`run_layer` hands every layer to ``runner`` (held by the current forward context)."""
    with forward_state(region_runner=runner):
        yield


def _runner() -> RegionRunner | None:
    ctx = current_forward_context()
    return None if ctx is None else ctx.region_runner


def is_regional() -> bool:
    """Whether a region runner is installed (never true while dynamo traces: it cannot read a context variable)."""
    return not torch.compiler.is_compiling() and _runner() is not None


def run_layer(layer: nn.Module, ids: LayerIds, *args: Any, **kwargs: Any) -> Any:
    """``layer(*args, **kwargs)``, or through the installed region runner (a call that already carries the region
    flag is the region itself running, e.g. eagerly after dynamo gave up on it, and runs plainly)."""
    runner = None if torch.compiler.is_compiling() or kwargs.get(REGION_FLAG) else _runner()
    if runner is None:
        return layer(*args, **kwargs)
    return runner(layer, ids, args, kwargs)
