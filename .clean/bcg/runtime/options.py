"""Engine options: keyword arguments checked against :class:`~bcg.runtime.config.EngineConfig`'s fields, and the
signature that spells them out for ``help(Engine)`` and editors."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, get_type_hints

from bcg.runtime.config import EngineConfig

__all__ = ["engine_config", "signature_with_options"]


def engine_config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """``config`` (or the defaults) with ``options`` on top, validated; unknown names and a wrong ``config`` type are
    refused naming what is valid.

    Example::

        engine_config(None, {"device": "cpu"}).device      # 'cpu'
    """
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown Engine option(s) {unknown}; valid options: {sorted(names)}")
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig (or None, with options as keyword arguments), got "
                        f"{config!r} ({type(config).__name__})")
    base = {f.name: getattr(config, f.name) for f in fields(EngineConfig)} if config else {}
    return EngineConfig(**{**base, **options})


def signature_with_options(init: Callable[..., Any]) -> inspect.Signature:
    """``init``'s signature with ``**kwargs`` spelled out as EngineConfig's fields and defaults; built from the
    dataclass, so it cannot drift from it."""
    signature = inspect.signature(init, eval_str=True)
    head = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = get_type_hints(EngineConfig)

    def default(f: Any) -> Any:
        if f.default is not MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not MISSING else inspect.Parameter.empty

    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default(f),
                                 annotation=hints.get(f.name, f.type)) for f in fields(EngineConfig)]
    return signature.replace(parameters=head + options)
