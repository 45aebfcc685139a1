"""Which implementation serves a checkpoint: bcg's own model classes ("native") or the checkpoint's transformers code.

``model_impl`` (vLLM's flag of the same name):

* ``"auto"``: native when ``config.json``'s ``model_type`` is one the native loader maps (and it accepts every
  feature of the config), otherwise transformers;
* ``"native"``: bcg's own classes, with the loader's error for a checkpoint they do not cover;
* ``"transformers"``: ``AutoModelForCausalLM`` run as written (:mod:`bcg.models.hf`).

transformers is optional: only the transformers path imports it, and asking for it without it installed is an error
that says how to install it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from bcg.models.hf import require_transformers
from bcg.models.impl_names import MODEL_IMPLS, check_model_impl
from bcg.models.loader import CheckpointError, UnsupportedCheckpoint, config_from_hf, load_checkpoint, read_json
from bcg.ops.parallel import SINGLE, TensorParallel

__all__ = ["MODEL_IMPLS", "check_model_impl", "load_model_folder", "resolve_model_impl"]

def resolve_model_impl(path: str | os.PathLike, model_impl: str) -> str:
    """``"native"`` or ``"transformers"``: the implementation that serves the checkpoint folder ``path``.

    Raises:
        CheckpointError: no readable ``config.json``; or ``"native"`` asked for a checkpoint the native loader does
            not cover (its reason, and the transformers alternative).
        ImportError: the transformers path is needed and transformers is not installed.

    Example::

        resolve_model_impl("/models/Qwen3-0.6B", "auto")      # 'native'
        resolve_model_impl("/models/gpt-oss-20b", "auto")     # 'transformers'
    """
    check_model_impl(model_impl)
    config_path = Path(path) / "config.json"
    hf_config = read_json(config_path)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object, not a {type(hf_config).__name__}")
    if model_impl == "transformers":
        require_transformers(f"model_impl='transformers' for {os.fspath(path)!r}")
        return "transformers"
    try:
        config_from_hf(hf_config)
    except UnsupportedCheckpoint as e:
        if model_impl == "native":
            raise CheckpointError(f"{config_path}: {e}; model_impl='transformers' runs the checkpoint's "
                                  "transformers code as written") from None
        require_transformers(f"{os.fspath(path)!r} is not a model bcg implements natively ({e}), and running it "
                             "with transformers")
        return "transformers"
    except CheckpointError as e:  # malformed, not merely unsupported: transformers would fail on it too
        raise CheckpointError(f"{config_path}: {e}") from None
    return "native"


def load_model_folder(path: str | os.PathLike, model_impl: str, device: torch.device, dtype: torch.dtype,
                      auto_islands: bool = True, tp: TensorParallel = SINGLE) -> nn.Module:
    """The model of checkpoint folder ``path`` through the implementation :func:`resolve_model_impl` picks.

    Example::

        model = load_model_folder("/models/gpt-oss-20b", "auto", torch.device("cuda"), torch.bfloat16)
    """
    if resolve_model_impl(path, model_impl) == "native":
        return load_checkpoint(path, device, dtype, tp)
    if tp.is_parallel:
        raise ValueError(f"tensor parallel runs bcg's own models only, and {path} runs through transformers: use "
                         "model_impl='native' (if bcg knows the architecture) or tp_size=1")
    from bcg.models.hf.load import from_pretrained
    from bcg.models.hf.model import HFCausalLM

    return HFCausalLM(from_pretrained(path, device, dtype), auto_islands=auto_islands)
