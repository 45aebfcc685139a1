"""Models for benchmarks by name: the presets, a few real models' shapes (random weights, the native classes), and
``+field=value`` overrides of either, so one run can ask which field of a shape costs what."""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from bcg.models.config import ModelConfig, get_preset

__all__ = ["SHAPES", "model_spec"]

# Real models' shapes, random weights (the native classes; the same compute as their checkpoints by path).
SHAPES = {
    "llama-3.2-1b": ModelConfig(arch="dense", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                                num_kv_heads=8, head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5,
                                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True),
    "qwen3-0.6b": ModelConfig(arch="dense", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
                              num_kv_heads=8, head_dim=128, intermediate_size=3072, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                              qk_norm=True),
}


def model_spec(name: str) -> Any:
    """What ``Engine`` builds for ``name``: a shape of :data:`SHAPES`, a preset or a checkpoint folder; a shape or
    preset may be followed by ``+field=value`` overrides of its :class:`ModelConfig` (ints, floats, True/False), so
    one run can ask which field of a shape costs what.

    Example::

        >>> model_spec("llama-dense+vocab_size=151936+tie_word_embeddings=True").vocab_size
        151936
        >>> model_spec("llama-3.2-1b").num_layers
        16
    """
    base, *overrides = name.split("+")
    if not overrides:
        return SHAPES.get(name, name)
    config = SHAPES.get(base) or get_preset(base)
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"model {name!r}: {item!r} is not field=value of a ModelConfig field "
                             f"(e.g. {base}+vocab_size=32000)")
        try:
            changes[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"model {name!r}: {text!r} is no int, float or True/False") from None
    return dataclasses.replace(config, **changes)
