"""Which class implements which architecture, and building a model from a :class:`ModelConfig`.

Kept apart from :mod:`bcg.models.base` so the architecture modules import the base class and this module imports
them, with no circle.
"""

from __future__ import annotations

import torch

from bcg.models.base import CausalLM
from bcg.models.config import ModelConfig
from bcg.models.dense import DenseLM
from bcg.models.dsa import DSALM
from bcg.models.moe import MoELM
from bcg.ops.parallel import SINGLE, TensorParallel

__all__ = ["MODEL_CLASSES", "build_model", "materialize", "model_class"]

MODEL_CLASSES: dict[str, type[CausalLM]] = {"dense": DenseLM, "moe": MoELM, "dsa": DSALM}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The :class:`CausalLM` subclass implementing ``config.arch``."""
    return MODEL_CLASSES[config.arch]


def materialize(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                tp: TensorParallel = SINGLE) -> CausalLM:
    """Build the model for ``config`` on ``device`` in ``dtype`` with uninitialised weights (this rank's shards
    under tensor parallel).

    The module is first built on the meta device so no memory is spent on a throwaway init.
    """
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.post_init()
    return model.eval().requires_grad_(False)


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Build a randomly initialised model; the same seed gives the same weights (sharded: each rank's slice of them).

    Example:
        >>> from bcg.models.config import get_preset
        >>> a = build_model(get_preset("tiny-moe"), "cpu", torch.float32, seed=1)
        >>> b = build_model(get_preset("tiny-moe"), "cpu", torch.float32, seed=1)
        >>> all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        True
    """
    model = materialize(config, device, dtype, tp)
    generator = torch.Generator(device=torch.device(device)).manual_seed(seed)
    model.init_weights(generator)
    return model
