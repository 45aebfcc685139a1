"""What the transformers path honours and what it refuses, read from a model's config before anything runs.

Every refusal names the feature and the fix. Refused: RoPE whose frequencies depend on the batch's longest position
(``dynamic``, ``longrope``: on a packed batch that is another request's length) or of a type not checked here, a
non-causal model, and layer types other than full, sliding-window and DSA attention (linear attention, chunked
attention, state-space layers). What a layer's attention must receive to be computed right (its sliding window, its
soft-cap) is predicted from the config here and checked against what the model actually passes
(:func:`check_layer_calls`), so a model that would apply a feature only through a mask bcg never builds is refused
rather than run without it. The ends of the model (logit scales and soft-caps after the LM head) are known tails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bcg.models.hf import UnsupportedModelError

__all__ = ["DSA_LAYER_TYPES", "LogitTail", "check_config", "check_layer_calls", "expected_windows", "rope_types"]

# RoPE types computed from each token's own position (capturable, and the same for a request packed or alone).
SUPPORTED_ROPE = ("default", "linear", "yarn", "llama3")
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")  # 5.24 / 5.17 names
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", *DSA_LAYER_TYPES)


def rope_types(cfg: Any) -> set[str]:
    """The RoPE types a config uses (several when ``rope_parameters`` is per layer type).

    Example:
        >>> from types import SimpleNamespace
        >>> sorted(rope_types(SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0})))
        ['yarn']
    """
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return {"default"}
    if not rope or "rope_type" in rope or "type" in rope:
        return {rope.get("rope_type", rope.get("type", "default"))}
    return {v.get("rope_type", v.get("type", "default")) for v in rope.values() if isinstance(v, dict)} or {"default"}


def check_config(cfg: Any) -> None:
    """Refuses, by name, what bcg's transformers path cannot run correctly on packed, chunked batches.

    Raises:
        UnsupportedModelError: batch-dependent or unknown RoPE, a non-causal model, a layer type that is not
            attention bcg knows.
    """
    name = getattr(cfg, "model_type", type(cfg).__name__)
    unsupported = sorted(rope_types(cfg) - set(SUPPORTED_ROPE))
    if unsupported:
        why = ("their frequencies depend on the batch's longest position, so requests packed together would change "
               "each other's rotary embedding" if set(unsupported) & {"dynamic", "longrope"} else
               "bcg has not checked that they depend only on each token's own position")
        raise UnsupportedModelError(
            f"{name} uses RoPE type {', '.join(unsupported)}, which bcg's transformers path does not support: {why}. "
            f"Supported: {', '.join(SUPPORTED_ROPE)}.")
    if getattr(cfg, "is_causal", True) is False or getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is not a causal decoder (is_causal=False or an encoder-decoder); bcg "
                                    "prefills causal decoders only")
    others = sorted({t for t in getattr(cfg, "layer_types", None) or [] if t not in _ATTENTION_LAYER_TYPES})
    if others:
        raise UnsupportedModelError(
            f"{name} has layers of type {', '.join(others)}; bcg's transformers path runs full, sliding-window and "
            "DSA attention layers only")


def expected_windows(cfg: Any) -> list[int | None] | None:
    """Per layer, the sliding window its config asks for (None: full attention), or None when unknown.

    From ``layer_types`` where the config has them, else ``sliding_window`` on every layer (unless
    ``use_sliding_window`` is False). DSA layers expect none.
    """
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * cfg.num_hidden_layers
    return [window] * cfg.num_hidden_layers


def check_layer_calls(cfg: Any, model_name: str, calls: Sequence[Any], island_layers: Sequence[int]) -> None:
    """Checks that each layer's attention call (an :class:`~bcg.models.hf.attention.AttentionCall`) carries every
    feature its config asks for: bcg never builds the model's masks, so a window or soft-cap applied only through
    a mask would otherwise be lost.

    Raises:
        UnsupportedModelError: a layer the config makes sliding (or soft-capped) whose attention call has no window
            (no soft-cap); one whose module holds attention sinks but does not pass them.
    """
    windows = expected_windows(cfg)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    for call in calls:
        if call.layer_idx in island_layers:
            continue
        expected = windows[call.layer_idx] if windows is not None else None
        if expected is not None and call.sliding_window is None:
            raise UnsupportedModelError(
                f"{model_name} layer {call.layer_idx} ({call.module}) is a sliding-window layer (window {expected}) "
                "but passes no sliding_window to its attention function; bcg builds no masks, so the window would be "
                "lost. Run it with model_impl='native' if bcg knows the architecture.")
        if softcap is not None and call.softcap is None:
            raise UnsupportedModelError(
                f"{model_name} layer {call.layer_idx} ({call.module}) has attn_logit_softcapping={softcap} in its "
                "config but passes no softcap to its attention function")
        if call.module_has_sinks and not call.has_sinks:
            raise UnsupportedModelError(
                f"{model_name} layer {call.layer_idx} ({call.module}) holds attention sinks but does not pass them "
                "(s_aux) to its attention function")


@dataclass(frozen=True)
class LogitTail:
    """What a ``*ForCausalLM`` does to the LM head's output, from known config fields (applied in this order):
    ``logit_scale`` (cohere: multiply), ``logits_scaling`` (granite: divide), ``final_logit_softcapping``
    (gemma2/3: ``cap * tanh(logits / cap)``).

    Example:
        >>> LogitTail(final_softcap=2.0).apply(torch.tensor([100.0])).tolist()
        [2.0]
    """

    logit_scale: float | None = None
    logits_scaling: float | None = None
    final_softcap: float | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> LogitTail:
        return cls(getattr(cfg, "logit_scale", None), getattr(cfg, "logits_scaling", None),
                   getattr(cfg, "final_logit_softcapping", None))

    def apply(self, logits: Tensor) -> Tensor:
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
