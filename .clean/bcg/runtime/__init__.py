"""The prefill runtime: the engine, its scheduler and packed batches, the token-bucket runner and its backends.

The names below are imported on first use, as in :mod:`bcg`: the torch-free modules of this package
(:mod:`.backend_registry`, :mod:`.schedule_policies`) must be importable without the engine, for ``bcg load --help``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bcg.lazy import lazy_exports

if TYPE_CHECKING:
    from bcg.runtime.backend_registry import BACKENDS
    from bcg.runtime.config import EngineConfig
    from bcg.runtime.engine import Engine, PrefillResult
    from bcg.runtime.serving import EngineClosedError, RequestResult

# Each public name and the module that defines it.
_HOMES = {
    "BACKENDS": "bcg.runtime.backend_registry",
    "Engine": "bcg.runtime.engine",
    "EngineClosedError": "bcg.runtime.serving",
    "EngineConfig": "bcg.runtime.config",
    "PrefillResult": "bcg.runtime.engine",
    "RequestResult": "bcg.runtime.serving",
}
__all__ = ["BACKENDS", "Engine", "EngineClosedError", "EngineConfig", "PrefillResult", "RequestResult"]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
