"""The prefill runtime: the engine, its scheduler and packed batches, the token-bucket runner and its backends."""

from bcg.runtime.config import BACKENDS, EngineConfig
from bcg.runtime.engine import Engine, PrefillResult

__all__ = ["BACKENDS", "Engine", "EngineConfig", "PrefillResult"]
