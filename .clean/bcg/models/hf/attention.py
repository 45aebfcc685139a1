"""bcg's attention for transformers models, registered in transformers' ``AttentionInterface`` as ``"bcg"``.

A transformers attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, scaling=..., dropout=..., **kwargs)`` with ``(1, heads, rows, head_dim)`` tensors and
expects ``(1, rows, heads, v_head_dim)`` back. Under ``"bcg"`` the decoder body runs on the packed rows of a batch,
and :func:`bcg_attention`

* checks what it was given, refusing by name what it cannot honour: dropout, a non-causal module, a mask the model
  built itself, keys that are not the rows' own, and any attention kwarg it does not know;
* turns the layer's features into the island's (``sliding_window``, ``softcap``, ``s_aux`` sinks, ``scaling``);
* moves q/k/v to the token-major layout (into bcg's bridge buffers while the runner captures) and calls bcg's
  attention island :func:`bcg.ops.attention.attention`, which writes the KV pool and attends over the live batch
  (FlashAttention varlen on CUDA).

``"bcg"`` is registered in ``AttentionInterface`` only, not in ``AttentionMaskInterface``, so transformers'
``create_causal_mask`` returns ``None`` at once: no mask is built, and its packed-sequence detection (a host read)
never runs. Two modes serve the adapter: while :func:`recording_calls` is active a call records what the layer
asked for and computes nothing (the adapter's probe), and inside a DSA module island (:mod:`bcg.models.hf.dsa`,
:func:`module_island_mode`) the call is one request's masked attention over the keys the island gathered.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bcg.models.hf import UnsupportedModelError, require_transformers
from bcg.models.regions import REGION_FLAG
from bcg.ops import bridge
from bcg.ops.attention import attention
from bcg.ops.attention.features import request_attention, visible_keys
from bcg.ops.region_islands import region_attention

__all__ = ["NAME", "AttentionCall", "bcg_attention", "module_island_mode", "recording_calls", "register"]

NAME = "bcg"
# Attention kwargs that carry nothing a prefill attention needs: transformers' cache bookkeeping (bcg's pool and
# forward context replace it) and flags. Any other kwarg that is set is refused by name.
_IGNORED = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values", "cache",
                      "past_key_value", "is_causal", REGION_FLAG})


@dataclass(frozen=True)
class AttentionCall:
    """What one layer's attention module passed to the attention function (recorded by the adapter's probe)."""

    layer_idx: int
    module: str
    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    scaling: float
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    module_has_sinks: bool
    has_indices: bool


_RECORDING: contextvars.ContextVar[list[AttentionCall] | None] = contextvars.ContextVar("bcg_hf_recording",
                                                                                        default=None)
_IN_MODULE_ISLAND: contextvars.ContextVar[bool] = contextvars.ContextVar("bcg_hf_module_island", default=False)


@contextmanager
def recording_calls() -> Iterator[list[AttentionCall]]:
    """Inside the block, attention calls append an :class:`AttentionCall` to the yielded list and return zeros."""
    calls: list[AttentionCall] = []
    token = _RECORDING.set(calls)
    try:
        yield calls
    finally:
        _RECORDING.reset(token)


@contextmanager
def module_island_mode() -> Iterator[None]:
    """Inside the block (a module island running one request), attention is masked attention over the given keys."""
    token = _IN_MODULE_ISLAND.set(True)
    try:
        yield
    finally:
        _IN_MODULE_ISLAND.reset(token)


def bcg_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """The ``AttentionInterface`` entry point (see the module doc): ``(1, rows, heads, v_head_dim)`` and no weights.

    Raises:
        UnsupportedModelError: the call asks for something bcg cannot honour (the message names it).
    """
    name = type(module).__name__
    _check(name, module, query, key, dropout, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    sinks, indices = kwargs.get("s_aux"), kwargs.get("indices")
    if not torch.compiler.is_compiling():  # dynamo cannot trace ContextVar reads; neither mode runs compiled
        calls = _RECORDING.get()
        if calls is not None:
            calls.append(AttentionCall(module.layer_idx, name, tuple(query.shape), tuple(key.shape),
                                       tuple(value.shape), key.dtype, float(scaling), window, softcap,
                                       sinks is not None, isinstance(getattr(module, "sinks", None), Tensor),
                                       indices is not None))
            return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
        if _IN_MODULE_ISLAND.get():
            return masked_attention(query, key, value, attention_mask, float(scaling), window, softcap, sinks,
                                    indices), None
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{name} (layer {module.layer_idx}) received an attention mask {tuple(attention_mask.shape)}: the model "
            "builds a mask of its own (not transformers' causal or sliding-window mask), so bcg cannot tell what it "
            "means. Run it with model_impl='native' if bcg knows the architecture.")
    if indices is not None:
        raise UnsupportedModelError(
            f"{name} (layer {module.layer_idx}) passes sparse top-k indices (a DSA indexer) outside a module island; "
            "bcg runs DSA attention modules as module islands (bcg.models.hf.dsa), which did not recognise this one")
    if query.shape[2] != key.shape[2]:
        raise UnsupportedModelError(
            f"{name} (layer {module.layer_idx}) attends {query.shape[2]} rows over {key.shape[2]} keys: its keys are "
            "not its own rows' (a cache or cross-attention), which bcg's packed prefill does not support")
    rows, heads, v_dim = query.shape[2], query.shape[1], value.shape[-1]
    # (1, H, S, D) -> token-major (S, H, D) views; while the runner captures, carry copies them into bridge buffers
    # shared by every layer and bucket, and the island writes a shared output (v's head dim may differ from q's).
    q, k, v = bridge.carry("hf_attn", query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = bridge.empty("hf_attn.out", (rows, heads, v_dim), query.dtype, query.device)
    scale = None if scaling == query.shape[-1] ** -0.5 else float(scaling)
    if sinks is not None:
        sinks = sinks.float()  # cast inside the graph segment, not at every replay of the island
    if kwargs.get(REGION_FLAG):  # a compiled region shared by layers: the island learns its layer when it runs
        region_attention(q, k, v, out, scale, window, softcap, sinks)
    else:
        attention(q, k, v, out, module.layer_idx, scale, window, softcap, sinks)
    return out[None], None


def _check(name: str, module: nn.Module, query: Tensor, key: Tensor, dropout: float, kwargs: dict) -> None:
    if not isinstance(getattr(module, "layer_idx", None), int):
        raise UnsupportedModelError(f"{name} has no integer layer_idx, so bcg cannot pick its KV-cache layer")
    if dropout:
        raise UnsupportedModelError(f"{name} asks for attention dropout {dropout} (training mode?); call model.eval()")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"{name} (layer {module.layer_idx}) is not causal; bcg prefills causal attention")
    if query.shape[0] != 1:
        raise UnsupportedModelError(f"{name}: bcg runs packed rows as batch 1, got batch {query.shape[0]}")
    if query.shape[1] % key.shape[1]:
        raise UnsupportedModelError(f"{name}: {query.shape[1]} query heads are not a multiple of {key.shape[1]} KV "
                                    "heads")
    for k, val in kwargs.items():
        if k in _IGNORED or k in ("sliding_window", "softcap", "s_aux", "indices") or val is None or val is False:
            continue
        raise UnsupportedModelError(
            f"{name} (layer {module.layer_idx}) passes attention kwarg {k}={_describe(val)}, which bcg's attention "
            "does not implement; bcg refuses rather than ignore it. Use model_impl='native' if bcg knows the "
            "architecture.")
    window = kwargs.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise UnsupportedModelError(f"{name}: sliding_window={window!r} is not a positive int")
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, Tensor) or tuple(sinks.shape) != (query.shape[1],)):
        raise UnsupportedModelError(f"{name}: attention sinks s_aux={_describe(sinks)} are not one logit per query "
                                    f"head ({query.shape[1]})")


def _describe(v: object) -> str:
    return f"Tensor{tuple(v.shape)}" if isinstance(v, Tensor) else repr(v)


def masked_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float,
                     window: int | None, softcap: float | None, sinks: Tensor | None,
                     indices: Tensor | None) -> Tensor:
    """One request's attention in transformers' layout, inside a module island: ``(1, H, Lq, D)`` over
    ``(1, Hkv, Lk, D)`` -> ``(1, Lq, H, Dv)``. Causal from the bottom right; ``attention_mask`` (bool, True =
    visible, or additive) narrows it, and so do ``indices`` ``(1, Lq, topk)``, the DSA indexer's picks."""
    len_q, len_k = query.shape[2], key.shape[2]
    allowed = visible_keys(len_q, len_k - len_q, window, query.device)
    if attention_mask is not None:
        mask = attention_mask[0, 0, -len_q:, -len_k:]
        allowed = allowed & (mask if mask.dtype == torch.bool else mask == 0)
    if indices is not None:
        picks = indices[0].long()
        # Counts, not a boolean scatter: a negative (unused) pick must not mark key 0, whatever the write order.
        hits = torch.zeros(len_q, len_k, dtype=torch.int32, device=query.device)
        hits.scatter_add_(-1, picks.clamp_min(0), (picks >= 0).int())
        allowed = allowed & (hits > 0)
    out = request_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), allowed,
                            scaling, softcap, sinks)
    return out[None]


def register() -> str:
    """Registers :func:`bcg_attention` as ``"bcg"`` in transformers' ``AttentionInterface`` (idempotent)."""
    transformers = require_transformers("bcg's transformers path")
    transformers.AttentionInterface.register(NAME, bcg_attention)
    return NAME
