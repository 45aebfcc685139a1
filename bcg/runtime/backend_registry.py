"""The prefill backends by name, the one list to edit for a new one (its module goes in
:mod:`bcg.runtime.backends`): the engine's option check (:class:`~bcg.runtime.config.EngineConfig`) and the runner
read it. Names match SGLang's ``--cuda-graph-backend-prefill`` values. It sits below the config and the backends,
which both read it; a backend's module is imported when it is chosen, so its own dependencies load only then (and
this module imports no torch: ``bcg verify --help`` lists the names).
"""

from __future__ import annotations

import importlib

__all__ = ["ALIASES", "BACKENDS", "DEFAULT_FULL_GRAPH_TOKENS", "REGISTRY", "backend_class", "resolve_backend"]

# name -> (module, class)
REGISTRY = {
    "eager": ("bcg.runtime.backends.eager", "EagerBackend"),
    "breakable": ("bcg.runtime.backends.breakable", "BreakableBackend"),
    "full": ("bcg.runtime.backends.full", "FullBackend"),
    "tc_piecewise": ("bcg.runtime.backends.tc_piecewise", "TcPiecewiseBackend"),
}
# SGLang's name for no graphs.
ALIASES = {"disabled": "eager"}
BACKENDS = tuple(REGISTRY)
# Where "breakable" on one GPU also captures whole-step graphs by default (EngineConfig.full_graph_tokens): every
# bucket up to 2048 tokens, the default chunk (larger ones are not measured). At the small ones the islands' launches
# weigh most against the device time (an H200 at 64 tokens: 59 host launches a prefill become 3). Up to round 15
# they stopped at 512 tokens (1024 for attention narrower than 2048), where the island's attention turns to bcg's
# Triton kernel: the whole-step graphs' kernel then read keys through their slots and cost up to 1.12x the wall
# (round 14). Reading them by address above 512 tokens (bcg.ops.attention.static_triton.RUNS_TOKENS), on the H200
# (round 16, benchmarks/device_bound.py, two rounds in turn) the whole-step graphs to 2048 took 0.98-1.02x the
# islanded graphs' device time at 1024 and 2048 tokens on llama-dense and the Llama-3.2-1B and Qwen3-0.6B shapes,
# the host 0.2-0.5x its time, the wall 0.95-1.01x, and the same graph memory (374 against 370 MiB on llama-dense).
DEFAULT_FULL_GRAPH_TOKENS = 2048


def resolve_backend(name: str) -> str:
    """Canonical backend name; raises ValueError naming the valid choices.

    Example:
        >>> resolve_backend("disabled")
        'eager'
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, one of {', '.join(BACKENDS)}; got {name!r}")
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} (or 'disabled')")
    return name


def backend_class(name: str) -> type:
    """The :class:`~bcg.runtime.backends.base.GraphBackend` subclass called ``name`` (already validated by
    EngineConfig), imported on first use.

    Example:
        >>> backend_class("breakable").__name__
        'BreakableBackend'
    """
    module, cls = REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"backend {name!r} is not available in this build ({e})") from e
    return getattr(mod, cls)
