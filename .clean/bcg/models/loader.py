"""Loading Hugging Face checkpoints (``config.json`` + safetensors) into the model zoo.

Supported ``model_type``: ``llama``, ``qwen3`` (q/k norm) and ``qwen3_moe``. Our modules fuse
q/k/v and gate/up projections and stack the experts, so the loader concatenates the per-projection
(and per-expert) tensors of the checkpoint; the fused ``experts.gate_up_proj``/``down_proj``
layout of recent transformers versions is accepted too. Under tensor parallel each rank reads only its
slices (safetensors ``get_slice``), as its parameters' :class:`~bcg.models.parallel_layers.ShardSpec` say.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from bcg.models.base import CausalLM
from bcg.models.config import ModelConfig
from bcg.models.parallel_layers import Part, ShardSpec, shard_specs, take_rows
from bcg.models.registry import materialize
from bcg.ops.parallel import SINGLE, TensorParallel

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
# Checkpoint entries that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint is unsupported, inconsistent with its config, or incomplete."""


class UnsupportedCheckpoint(CheckpointError):
    """A well-formed checkpoint of a model type or feature the native loader does not implement (transformers may
    run it); malformed ones raise :class:`CheckpointError` itself."""


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face ``config.json`` dict to a :class:`ModelConfig`.

    Raises:
        CheckpointError: unsupported model type or feature (RoPE scaling, sliding window, non-SiLU
            activation, dense layers inside an MoE model, ...).

    Example:
        >>> config_from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        ...                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...                 "intermediate_size": 128}).head_dim
        16
    """
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpoint(f"unsupported model_type {model_type!r}; supported: "
                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        return _map_config(model_type, hf_config)
    except KeyError as exc:
        raise CheckpointError(f"{model_type} config.json lacks the required key {exc.args[0]!r}") from None


def _map_config(model_type: str, hf_config: dict[str, Any]) -> ModelConfig:
    def unsupported(what: str) -> CheckpointError:
        return UnsupportedCheckpoint(f"{model_type} checkpoint uses {what}, which bcg does not implement")

    if hf_config.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act={hf_config['hidden_act']!r}")
    if hf_config.get("mlp_bias"):
        raise unsupported("mlp_bias")
    # transformers >= 5 nests RoPE settings in `rope_parameters`; older configs use `rope_scaling`.
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise unsupported(f"RoPE scaling {rope_type!r}")
    if hf_config.get("use_sliding_window") or any(t != "full_attention" for t in hf_config.get("layer_types") or []):
        raise unsupported("sliding-window attention")

    _check_types(hf_config)
    hidden_size, num_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    fields: dict[str, Any] = dict(
        arch="dense",
        vocab_size=hf_config["vocab_size"],
        hidden_size=hidden_size,
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or hidden_size // num_heads,
        intermediate_size=hf_config["intermediate_size"],
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=hf_config.get("rope_theta", rope.get("rope_theta", 10000.0)),
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        attention_bias=bool(hf_config.get("attention_bias", False)),
    )
    if model_type == "qwen3_moe":
        if hf_config.get("mlp_only_layers") or hf_config.get("decoder_sparse_step", 1) != 1:
            raise unsupported("dense layers between MoE layers (mlp_only_layers / decoder_sparse_step)")
        fields.update(
            arch="moe",
            # Renamed to num_local_experts in transformers >= 5.
            num_experts=hf_config.get("num_experts") or hf_config["num_local_experts"],
            num_experts_per_tok=hf_config["num_experts_per_tok"],
            moe_intermediate_size=hf_config["moe_intermediate_size"],
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
        )
    return ModelConfig(**fields)


# config.json keys that must be positive ints (when present and not null), and keys that must be numbers.
_INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "max_position_embeddings", "num_experts", "num_local_experts",
             "num_experts_per_tok", "moe_intermediate_size")
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def _check_types(hf_config: dict[str, Any]) -> None:
    for key in _INT_KEYS:
        value = hf_config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CheckpointError(f"{key} must be a positive int, got {value!r}")
    for key in _FLOAT_KEYS:
        value = hf_config.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise CheckpointError(f"{key} must be a number, got {value!r}")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None


def _open_safetensors(path: Path, stack: ExitStack) -> Any:
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except Exception as e:  # safetensors raises its own error types; name the file instead
        raise CheckpointError(f"{path} cannot be read as safetensors (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from None


class _CheckpointReader:
    """Lazy name -> tensor (or slice) access over one or more safetensors files; remembers what was read."""

    def __init__(self, folder: Path, stack: ExitStack) -> None:
        index_path = folder / "model.safetensors.index.json"
        if index_path.exists():
            index = read_json(index_path)
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                raise CheckpointError(f"{index_path} has no weight_map object")
            files = sorted(set(index["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {folder}")
        self.handles: dict[str, Any] = {}
        self.paths: dict[str, Path] = {}
        for file in files:
            handle = _open_safetensors(folder / file, stack)
            self.handles.update(dict.fromkeys(handle.keys(), handle))
            self.paths.update(dict.fromkeys(handle.keys(), folder / file))
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.handles

    def __call__(self, name: str, dim: int = 0, part: Part | None = None, offset: int = 0) -> Tensor:
        """The tensor ``name``, or with ``part`` only its rows of that part (starting at ``offset``) along ``dim``."""
        if name not in self.handles:
            raise KeyError(name)
        self.used.add(name)
        try:
            if part is None:
                return self.handles[name].get_tensor(name)
            lazy = self.handles[name].get_slice(name)
            shape = lazy.get_shape()
        except Exception as e:  # name the file and the tensor
            raise CheckpointError(f"{self.paths[name]} cannot be read as safetensors (truncated or corrupt?): tensor "
                                  f"{name}: {type(e).__name__}: {e}") from None
        if dim >= len(shape) or shape[dim] < offset + part.size:
            raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(shape)} has no {part.size} rows "
                                  f"at {offset} along dim {dim}, which the model shards")
        start, stop = min(part.start, part.size), min(part.stop, part.size)  # rows past the part are padding
        rows = lazy[(slice(None),) * dim + (slice(offset + start, offset + stop),)]
        return take_rows(rows, dim, Part(stop - start, 0, part.stop - part.start))


def _hf_tensor(name: str, get: _CheckpointReader, num_experts: int, spec: ShardSpec | None = None) -> Tensor:
    """Assemble our parameter ``name`` from the checkpoint tensors it corresponds to (this rank's slice of each
    when ``spec`` says the parameter is sharded)."""

    def part(i: int) -> Part | None:
        return None if spec is None else spec.parts[i]

    dim = 0 if spec is None else spec.dim
    if not name.startswith("layers."):
        return get(name if name.startswith("lm_head.") else f"model.{name}", dim, part(0))
    layer_id, rest = name.removeprefix("layers.").split(".", 1)
    prefix = f"model.layers.{layer_id}."
    if rest.startswith("self_attn.qkv.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]  # weight or bias
        return torch.cat([get(f"{prefix}self_attn.{p}_proj.{kind}", 0, part(i)) for i, p in enumerate("qkv")])
    if rest.startswith("self_attn.qkv."):  # q_norm / k_norm
        return get(prefix + "self_attn." + rest.removeprefix("self_attn.qkv."))
    if rest == "mlp.gate_up_proj.weight":
        return torch.cat([get(f"{prefix}mlp.gate_proj.weight", 0, part(0)),
                          get(f"{prefix}mlp.up_proj.weight", 0, part(1))])
    if rest in ("mlp.experts_gate_up", "mlp.experts_down"):
        fused = prefix + ("mlp.experts.gate_up_proj" if rest == "mlp.experts_gate_up" else "mlp.experts.down_proj")
        if get.has(fused):
            if spec is None:
                return get(fused)
            offsets = [sum(q.size for q in spec.parts[:i]) for i in range(len(spec.parts))]
            return torch.cat([get(fused, dim, p, o) for p, o in zip(spec.parts, offsets)], dim=dim)
        experts = prefix + "mlp.experts."
        if rest == "mlp.experts_down":  # per expert (H, I): the stacked dim 2 is its dim 1
            return torch.stack([get(f"{experts}{e}.down_proj.weight", 1, part(0)) for e in range(num_experts)])
        return torch.stack([torch.cat([get(f"{experts}{e}.gate_proj.weight", 0, part(0)),
                                       get(f"{experts}{e}.up_proj.weight", 0, part(1))]) for e in range(num_experts)])
    return get(prefix + rest, dim, part(0))


def load_checkpoint(path: str | Path, device: torch.device | str, dtype: torch.dtype,
                    tp: TensorParallel = SINGLE) -> CausalLM:
    """Load a Hugging Face-layout checkpoint folder into a :class:`CausalLM`.

    Reads ``config.json`` and ``*.safetensors`` (sharded via ``model.safetensors.index.json`` or
    not), casting every tensor to ``dtype`` on ``device``. Under tensor parallel (``tp``) only this rank's
    slices of sharded weights are read.

    Raises:
        CheckpointError: unsupported model type or feature, missing or unexpected tensors,
            shape mismatch, or no weights in the folder.

    Example::

        model = load_checkpoint("/models/Qwen3-0.6B", "cuda", torch.bfloat16)
    """
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object, not a {type(raw).__name__}")
    try:
        config = config_from_hf(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{config_path}: {e}") from None
    model = materialize(config, device, dtype, tp)
    specs = shard_specs(model)
    missing: list[str] = []
    with ExitStack() as stack, torch.no_grad():
        reader = _CheckpointReader(folder, stack)
        for name, param in model.named_parameters():
            try:
                tensor = _hf_tensor(name, reader, config.num_experts, specs.get(name))
            except KeyError as exc:
                missing.append(str(exc.args[0]))
                continue
            if tensor.shape != param.shape:
                raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                      f"model {tuple(param.shape)}")
            param.copy_(tensor)
        ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
        unexpected = sorted(n for n in reader.handles
                            if n not in reader.used and n not in ignorable and not n.endswith(_IGNORED_SUFFIXES))
    if missing or unexpected:
        details = _summary("missing", missing) + _summary("unexpected", unexpected)
        raise CheckpointError(f"checkpoint {folder} does not match its {config.arch} model:{details}")
    return model


def _summary(label: str, names: list[str], limit: int = 8) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
    return f" {label}: {shown};"

