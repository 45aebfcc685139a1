"""The prefill runtime: the engine, its scheduler and packed batches, the token-bucket runner and its backends."""

from bcg.runtime.config import BACKENDS, EngineConfig
from bcg.runtime.engine import Engine, PrefillResult
from bcg.runtime.serving import EngineClosedError, RequestResult

__all__ = ["BACKENDS", "Engine", "EngineClosedError", "EngineConfig", "PrefillResult", "RequestResult"]
