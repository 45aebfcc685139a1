"""Getting a transformers model onto the engine's device and dtype without recasting it.

transformers keeps some modules in fp32 on purpose (``_keep_in_fp32_modules``: MoE routers, score-correction
biases, DSA indexer weights), so ``model.to(dtype)`` would change its numbers. A model loaded here is loaded by
transformers in the asked dtype (``from_pretrained(path, dtype=...)``, which honours those modules) and then moved
to the device; a model the user passes is never cast: its dtype becomes the engine's, and asking for another is an
error that says how to load it. Moving it to another device (``.to(device)``) keeps every parameter's dtype.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from bcg.models.hf import UnsupportedModelError, require_transformers

__all__ = ["check_devices", "from_pretrained", "place"]

logger = logging.getLogger("bcg")


def from_pretrained(path: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` on ``device``, in eval mode.

    Example::

        hf = from_pretrained("/models/Qwen3-0.6B", torch.device("cuda"), torch.bfloat16)
    """
    transformers = require_transformers(f"loading {os.fspath(path)!r} with model_impl='transformers'")
    model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype)
    return model.to(device).eval()


def _model_dtype(model: nn.Module) -> torch.dtype:
    embed = model.get_input_embeddings()
    return embed.weight.dtype if embed is not None else next(model.parameters()).dtype


def place(model: nn.Module, device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """The device and dtype an engine runs a passed transformers model in; moves it to ``device`` if asked.

    ``None`` takes the model's own (its input embedding's dtype: the hidden states' dtype). A ``dtype`` other than
    the model's is an error: the engine does not recast a transformers model.

    Example::

        place(hf_model, None, None)          # (device(type='cuda', index=0), torch.bfloat16): where it is

    Raises:
        UnsupportedModelError: the model has no weights (the meta device).
        ValueError: ``dtype`` is not the model's.
    """
    check_devices(model, one_device=False)  # before moving: a meta model has nothing to move
    have_dtype = _model_dtype(model)
    if dtype is not None and getattr(torch, dtype, None) != have_dtype:
        have = str(have_dtype).removeprefix("torch.")
        raise ValueError(
            f"the transformers model is in {have} but dtype={dtype!r} was asked; bcg does not recast a transformers "
            f"model (model.to(dtype) would undo the modules transformers keeps in fp32). Load it with "
            f"from_pretrained(..., dtype=torch.{dtype}), or leave dtype unset (or {have!r})")
    have_device = next(model.parameters()).device
    if device is None:
        return have_device, have_dtype
    want = torch.device(device)
    same = want.type == have_device.type and (want.index is None or want.index == have_device.index)
    if not same:
        logger.info("bcg: moving the transformers model from %s to %s (dtypes unchanged)", have_device, want)
        model.to(want)
        have_device = next(model.parameters()).device
    return have_device, have_dtype


def check_devices(model: nn.Module, one_device: bool = True) -> None:
    """Refuses a model built without weights (the meta device) or, with ``one_device``, spread over devices, naming
    the fix."""
    name = type(model).__name__
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        raise UnsupportedModelError(
            f"{name}'s weights are on the meta device (it was built without weights: under torch.device('meta') "
            "or init_empty_weights, or loaded with device_map='meta'), so there is nothing to run; load it with "
            "its weights, e.g. AutoModelForCausalLM.from_pretrained(path, dtype=...), or pass the checkpoint "
            "folder to Engine")
    devices = {t.device for t in tensors}
    if one_device and len(devices) != 1:
        raise UnsupportedModelError(f"{name} has parameters on {sorted(map(str, devices))}; bcg runs a model on "
                                    "one device: load it without device_map, then .to(device)")
