"""Serving under load: the request front end of :meth:`Engine.submit <bcg.runtime.engine.Engine.submit>`, its
scheduler (:mod:`.server` the threads, :mod:`.batcher` the decisions, :mod:`.policy` the order), the prefix cache
whose hits replay the same graphs (:mod:`.prefix_cache`), the request records (:mod:`.request`), and the gate every
caller of an engine waits on (:mod:`.gate`)."""

from bcg.runtime.serving.gate import ActivityGate
from bcg.runtime.serving.policy import POLICIES
from bcg.runtime.serving.prefix_cache import CacheHit, PrefixCache
from bcg.runtime.serving.request import EngineClosedError, RequestResult
from bcg.runtime.serving.server import Server

__all__ = ["POLICIES", "ActivityGate", "CacheHit", "EngineClosedError", "PrefixCache", "RequestResult", "Server"]
