"""The prefill runtime: the engine, its scheduler and packed batches, the token-bucket runner and its backends.

The names below are imported on first use, as in :mod:`bcg`: the torch-free modules of this package
(:mod:`.backend_registry`, :mod:`.schedule_policies`) must be importable without the engine, for ``bcg load --help``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'bcg.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
