"""Prefill backends behind one interface; names match SGLang's --cuda-graph-backend-prefill values.

A new backend is one module here with a :class:`GraphBackend` subclass and one line in :data:`REGISTRY`; the
engine's option check (``EngineConfig.backend``) reads the same table.
"""

from __future__ import annotations

import importlib

from bcg.runtime.backends.base import BackendRefused, GraphBackend, GraphResources

__all__ = ["ALIASES", "REGISTRY", "BackendRefused", "GraphBackend", "GraphResources", "backend_class"]

# name -> (module, class); imported on first use, so a backend's own dependencies load only when it is chosen.
REGISTRY = {
    "eager": ("bcg.runtime.backends.eager", "EagerBackend"),
    "breakable": ("bcg.runtime.backends.breakable", "BreakableBackend"),
    "full": ("bcg.runtime.backends.full", "FullBackend"),
    "tc_piecewise": ("bcg.runtime.backends.tc_piecewise", "TcPiecewiseBackend"),
}
# SGLang's name for no graphs.
ALIASES = {"disabled": "eager"}


def backend_class(name: str) -> type[GraphBackend]:
    """The backend class called ``name`` (already validated by EngineConfig); imported on first use."""
    module, cls = REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"backend {name!r} is not available in this build ({e})") from e
    return getattr(mod, cls)
