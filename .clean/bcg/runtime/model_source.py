"""What ``Engine(model=...)`` accepts, and how each kind becomes the model the engine serves.

A preset name, a checkpoint folder (bcg's own classes or transformers', by ``model_impl``), a :class:`ModelConfig`, a
built model or a transformers ``*ForCausalLM``. Apart from the engine because it runs once, before anything the
engine owns exists: it settles the device and dtype (a transformers model keeps its own) and refuses what tensor
parallel or ``model_impl`` cannot serve, naming the fix.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from bcg.models.base import CausalLM
from bcg.models.config import PRESETS, ModelConfig, get_preset
from bcg.models.hf import is_transformers_model
from bcg.models.model_impl import load_model_folder
from bcg.models.registry import build_model
from bcg.ops.parallel import TensorParallel
from bcg.runtime.config import EngineConfig

__all__ = ["load_model"]


def load_model(model: Any, cfg: EngineConfig, tp: TensorParallel) -> tuple[torch.nn.Module, EngineConfig]:
    """The model to serve and the config with its device and dtype settled (a transformers model keeps its own)."""
    if is_transformers_model(model):
        if cfg.model_impl == "native":
            raise ValueError("model_impl='native' needs a checkpoint folder, a preset or a ModelConfig; a transformers "
                             "model object runs as written (model_impl='auto' or 'transformers')")
        if tp.is_parallel:
            raise ValueError("tensor parallel runs bcg's own models only: load the checkpoint folder with "
                             "model_impl='native', or use tp_size=1 for a transformers model")
        from bcg.models.hf.load import place
        from bcg.models.hf.model import HFCausalLM

        device, dtype = place(model, cfg.device, cfg.dtype)
        cfg = replace(cfg, device=str(device), dtype=str(dtype).removeprefix("torch."))
        return HFCausalLM(model, auto_islands=cfg.auto_islands), cfg
    device, dtype = cfg.torch_device, cfg.torch_dtype
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        return load_model_folder(model, cfg.model_impl, device, dtype, cfg.auto_islands, tp), cfg
    if cfg.model_impl == "transformers":
        raise ValueError(f"model_impl='transformers' needs a checkpoint folder or a transformers model, not "
                         f"{model!r} (presets, ModelConfigs and built models are bcg's own)")
    if isinstance(model, torch.nn.Module):
        if not isinstance(model, CausalLM):
            raise TypeError(f"{type(model).__name__} is not a bcg CausalLM: pass a model built by "
                            "bcg.models.build_model or load_checkpoint, a transformers *ForCausalLM, a preset name, a "
                            "ModelConfig or a checkpoint folder")
        built = getattr(model, "tp", None)
        if built is not None and built.size != tp.size:
            raise ValueError(f"the model was built for tp_size={built.size}, but the engine runs tp_size={tp.size}; "
                             "pass a preset, config or checkpoint and let the engine shard it")
        return model.to(device=device, dtype=dtype), cfg
    if isinstance(model, ModelConfig):
        return build_model(model, device, dtype, cfg.seed, tp), cfg
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError("model must be a preset name, a checkpoint folder, a ModelConfig, a built model "
                        f"(torch.nn.Module) or a transformers model, got {model!r} ({type(model).__name__})")
    name = os.fspath(model)
    if name in PRESETS:
        return build_model(get_preset(name), device, dtype, cfg.seed, tp), cfg
    if os.path.exists(name):
        raise ValueError(f"model {name} is a file; pass the checkpoint folder that holds its config.json and "
                         "*.safetensors")
    if os.sep in name or (os.altsep and os.altsep in name) or name.startswith((".", "~")):
        raise FileNotFoundError(f"checkpoint folder {name} does not exist (presets: {', '.join(PRESETS)})")
    return build_model(get_preset(name), device, dtype, cfg.seed, tp), cfg
