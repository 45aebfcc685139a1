"""The prefill backends by name, the one list to edit for a new one (its module goes in
:mod:`bcg.runtime.backends`): the engine's option check (:class:`~bcg.runtime.config.EngineConfig`) and the runner
read it. Names match SGLang's ``--cuda-graph-backend-prefill`` values. It sits below the config and the backends,
which both read it; a backend's module is imported when it is chosen, so its own dependencies load only then (and
this module imports no torch: ``bcg verify --help`` lists the names).
"""

from __future__ import annotations

import importlib

__all__ = ["ALIASES", "BACKENDS", "DEFAULT_FULL_GRAPH_TOKENS", "NARROW_FULL_GRAPH_TOKENS", "REGISTRY", "backend_class",
           "resolve_backend"]

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
# Where "breakable" on one GPU also captures whole-step graphs by default (EngineConfig.full_graph_tokens): the
# buckets where the islands' launches weigh most against the device time (an H200 at 64 tokens: 59 host launches a
# prefill become 3), up to where the island's attention turns to bcg's Triton kernel (triton_from_tokens in
# bcg.ops.attention.varlen): below that the island runs FlashAttention and a copy, the whole-step graph bcg's slot
# kernel. On the H200 (round 14, benchmarks/device_bound.py, whole-step graphs to 2048 against the default):
# llama-dense (attention 1024 wide) took 0.82x the wall at 1024 tokens with them and 1.02x at 2048; the 2048-wide
# shapes, whose islands run the Triton kernel from 1024, 1.00x (Llama-3.2-1B) and 1.12x (Qwen3-0.6B) at 1024.
DEFAULT_FULL_GRAPH_TOKENS = 512
NARROW_FULL_GRAPH_TOKENS = 1024  # attention narrower than varlen.WIDE_ATTENTION (EngineConfig.resolved)


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
