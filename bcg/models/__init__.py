"""Model zoo: configs and presets, the :class:`CausalLM` interface, and checkpoint loading."""

from bcg.models.base import CausalLM
from bcg.models.config import PRESETS, ModelConfig, get_preset
from bcg.models.loader import load_checkpoint
from bcg.models.registry import build_model

__all__ = ["PRESETS", "CausalLM", "ModelConfig", "build_model", "get_preset", "load_checkpoint"]
