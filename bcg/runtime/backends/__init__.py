"""Prefill backends behind one interface; names match SGLang's --cuda-graph-backend-prefill values."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bcg.runtime.backends.base import BackendRefused, GraphBackend

if TYPE_CHECKING:
    from bcg.runtime.runner import Runner

__all__ = ["BackendRefused", "GraphBackend", "make_backend"]

_REGISTRY = {
    "eager": ("bcg.runtime.backends.eager", "EagerBackend"),
    "breakable": ("bcg.runtime.backends.breakable", "BreakableBackend"),
    "full": ("bcg.runtime.backends.full", "FullBackend"),
    "tc_piecewise": ("bcg.runtime.backends.tc_piecewise", "TcPiecewiseBackend"),
}


def make_backend(name: str, runner: Runner) -> GraphBackend:
    """Instantiates the backend called ``name`` (already validated by EngineConfig)."""
    module, cls = _REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"backend {name!r} is not available in this build ({e})") from e
    return getattr(mod, cls)(runner)
