"""Model zoo: configs and presets, the :class:`CausalLM` interface, and checkpoint loading.

The names below are imported on first use, as in :mod:`bcg`: ``bcg.models.config`` (the presets, plain data) must be
importable without torch, for ``bcg bench --help``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bcg.lazy import lazy_exports

if TYPE_CHECKING:
    from bcg.models.base import CausalLM
    from bcg.models.config import PRESETS, ModelConfig, get_preset
    from bcg.models.loader import load_checkpoint
    from bcg.models.registry import build_model

# Each public name and the module that defines it.
_HOMES = {
    "CausalLM": "bcg.models.base",
    "PRESETS": "bcg.models.config",
    "ModelConfig": "bcg.models.config",
    "build_model": "bcg.models.registry",
    "get_preset": "bcg.models.config",
    "load_checkpoint": "bcg.models.loader",
}
__all__ = ["PRESETS", "CausalLM", "ModelConfig", "build_model", "get_preset", "load_checkpoint"]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
