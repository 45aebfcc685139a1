"""Prefill backends behind one interface; names match SGLang's --cuda-graph-backend-prefill values."""

from __future__ import annotations

import importlib

from bcg.runtime.backends.base import BackendRefused, GraphBackend, GraphResources

__all__ = ["BackendRefused", "GraphBackend", "GraphResources", "backend_class"]

_REGISTRY = {
    "eager": ("bcg.runtime.backends.eager", "EagerBackend"),
    "breakable": ("bcg.runtime.backends.breakable", "BreakableBackend"),
    "full": ("bcg.runtime.backends.full", "FullBackend"),
    "tc_piecewise": ("bcg.runtime.backends.tc_piecewise", "TcPiecewiseBackend"),
}


def backend_class(name: str) -> type[GraphBackend]:
    """The backend class called ``name`` (already validated by EngineConfig); imported on first use."""
    module, cls = _REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"backend {name!r} is not available in this build ({e})") from e
    return getattr(mod, cls)
