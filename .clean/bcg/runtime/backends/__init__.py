"""Prefill backends behind one interface (:mod:`.base`); a new one is a module here and one line of
:data:`~bcg.runtime.backend_registry.REGISTRY`."""

from bcg.runtime.backend_registry import ALIASES, REGISTRY, backend_class
from bcg.runtime.backends.base import BackendRefused, GraphBackend, GraphResources

__all__ = ["ALIASES", "REGISTRY", "BackendRefused", "GraphBackend", "GraphResources", "backend_class"]
