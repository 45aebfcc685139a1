"""Runtime: forward context, KV pool, batch packing, attention island, runner and engine."""

from __future__ import annotations

from typing import Any

__all__ = ["BACKENDS", "Engine", "EngineConfig", "PrefillResult"]


def __getattr__(name: str) -> Any:
    # Lazy: the models import runtime submodules (context, attention), and the engine imports the models.
    if name in ("Engine", "PrefillResult"):
        from bcg.runtime import engine

        return getattr(engine, name)
    if name in ("BACKENDS", "EngineConfig"):
        from bcg.runtime import config

        return getattr(config, name)
    raise AttributeError(f"module 'bcg.runtime' has no attribute {name!r}")
