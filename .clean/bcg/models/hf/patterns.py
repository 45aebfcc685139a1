"""Which modules of a transformers decoder match a fused form, and what each one's stand-in is built from.

Driven by what transformers exposes: module classes and children (``q_proj``/``k_proj``/``v_proj`` or ``qkv_proj``,
``o_proj``, ``q_norm``/``k_norm``; ``gate_proj``/``up_proj``/``down_proj`` or ``gate_up_proj``; RMSNorm classes;
the decoder layer's sublayers), config fields (``layer_types``) and the body's rotary embedding buffers
(``inv_freq``, ``<layer type>_inv_freq``, their ``attention_scaling``), with no copy of any architecture's code.
Where a module's arithmetic is not visible from its structure (which scale an RMSNorm applies, whether an activation
is SiLU) it is decided on a random input. :func:`compare` is the test every stand-in must pass against its module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.models.hf.fused_attention import AttentionSpec, rope_layout
from bcg.models.hf.fused_layer import FusedDecoderLayer, FusedMLP, FusedRMSNorm, NoMatch, NormSpec, norm_eps
from bcg.tensors import tensor_leaves

__all__ = ["DIFFERS", "TOLERANCE", "NoMatch", "attention_specs", "compare", "decoder_layers", "is_attention",
           "is_norm", "is_silu", "make_layer", "make_mlp", "mlp_names", "norm_spec"]

# Largest difference a stand-in may show against the module it replaces, relative to the output's largest value:
# rounding only (the kernels round once where some modules round twice), far below what a wrong structure gives.
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LAYER_KINDS = {
    frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}): "pre_norm",
    frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp",
               "post_feedforward_layernorm"}): "sandwich",
    frozenset({"self_attn", "post_attention_layernorm", "mlp", "post_feedforward_layernorm"}): "post_norm",
}



def decoder_layers(body: nn.Module, config: Any) -> list[nn.Module]:
    layers = getattr(body, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == config.num_hidden_layers:
        return list(layers)
    return []


def is_attention(m: nn.Module, calls: dict[int, Any], skip: set[int]) -> bool:
    idx = getattr(m, "layer_idx", None)
    if not isinstance(idx, int) or idx in skip or idx not in calls or calls[idx].module != type(m).__name__:
        return False
    names = ("qkv_proj",) if isinstance(getattr(m, "qkv_proj", None), nn.Linear) else ("q_proj", "k_proj", "v_proj")
    return all(type(getattr(m, n, None)) is nn.Linear for n in (*names, "o_proj"))


def mlp_names(m: nn.Module) -> tuple[str, ...] | None:
    children = dict(m.named_children())
    for names in (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj")):
        if all(type(children.get(n)) is nn.Linear for n in names):
            extra = set(children) - set(names) - {"act_fn", "activation_fn"}
            return None if extra else names
    return None


def is_norm(m: nn.Module) -> bool:
    params = dict(m.named_parameters(recurse=False))
    return ("rmsnorm" in type(m).__name__.lower() and not list(m.children()) and list(params) == ["weight"]
            and params["weight"].ndim == 1 and norm_eps(m) is not None)


def compare(got: Any, want: Any, skip_rows: Tensor | None = None) -> str | None:
    """None if ``got`` is ``want`` to rounding (:data:`TOLERANCE`), else how it differs. ``skip_rows`` (bool,
    one per token) leaves those tokens' rows out: tokens whose routing is at a near-tie (:mod:`.moe_ties`)."""
    got_t, want_t = tensor_leaves(got), tensor_leaves(want)
    if len(got_t) != len(want_t) or any(a.shape != b.shape for a, b in zip(got_t, want_t)):
        return "its fused form returns another structure than the module"
    if skip_rows is not None:
        keep = ~skip_rows
        got_t, want_t = [a.reshape(keep.numel(), -1)[keep] for a in got_t], [b.reshape(keep.numel(), -1)[keep]
                                                                             for b in want_t]
    for a, b in zip(got_t, want_t):
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return "its fused form returns other values"
            continue
        rel = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        if not rel <= TOLERANCE.get(b.dtype, 1e-5):
            return f"its fused form {DIFFERS}{rel:.2g} (relative)"
    return None


def norm_spec(module: nn.Module) -> NormSpec:
    """Which RMSNorm the module computes, decided on a random input: ``w`` or ``1 + w`` as the scale."""
    if isinstance(module, FusedRMSNorm):
        return module.spec
    w = module.weight
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype) * 3
    with torch.inference_mode():
        want = module(x)
        for offset in (False, True):
            spec = NormSpec(module, offset)
            if compare(spec(x, "torch"), want) is None:
                return spec
    raise NoMatch("it is not w * x / rms(x) nor (1 + w) * x / rms(x)")


def make_mlp(module: nn.Module) -> FusedMLP:
    names = mlp_names(module)
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    if names is None or act is None:
        raise NoMatch("it is not a gate/up MLP with an activation")
    gate = getattr(module, names[0])
    if len(names) == 3 and (gate.bias is None) != (getattr(module, names[1]).bias is None):
        raise NoMatch("only one of its gate and up projections has a bias")
    return FusedMLP(module, names, None if is_silu(act, gate.weight) else act)


def is_silu(act: Any, like: Tensor) -> bool:
    """Whether the callable ``act`` is SiLU, bit for bit on a grid in ``like``'s dtype and device."""
    if not callable(act):
        return False
    x = torch.linspace(-6, 6, 97, device=like.device, dtype=like.dtype)
    with torch.inference_mode():
        return torch.equal(act(x), F.silu(x))


def make_layer(module: nn.Module) -> FusedDecoderLayer:
    # Dropout is the identity in eval mode (phi3's residual dropouts); anything else must be a known sublayer.
    names = frozenset(n for n, c in module.named_children() if not (isinstance(c, nn.Dropout) and not c.training))
    kind = LAYER_KINDS.get(names)
    if kind is None:
        raise NoMatch(f"its sublayers ({', '.join(sorted(names))}) are none of the pre-norm, sandwich and post-norm "
                      "layouts")
    scales = {k: v for k, v in vars(module).items() if isinstance(v, float) and ("multiplier" in k or "scal" in k)}
    residual_scale = scales.pop("residual_multiplier", 1.0)  # granite: h + m * sublayer(h), m a parameter
    if any(v != 1.0 for v in scales.values()):
        raise NoMatch(", ".join(f"{k}={v}" for k, v in scales.items()) + " scales its sublayers' outputs")
    if residual_scale != 1.0 and kind != "pre_norm":
        raise NoMatch(f"residual_multiplier={residual_scale} scales the sublayers of a {kind} layer")
    norms = {}
    for n in sorted(names):
        if n.endswith("layernorm"):
            child = getattr(module, n)
            if not isinstance(child, FusedRMSNorm):
                raise NoMatch(f"its {n} is not an RMSNorm bcg fused")
            norms[n] = child.spec
    return FusedDecoderLayer(module, kind, norms, residual_scale)


def attention_specs(module: nn.Module, call: Any, config: Any, body: nn.Module) -> Iterator[AttentionSpec]:
    _, heads, _, dim = call.query
    kv_heads, v_dim = call.key[1], call.value[3]
    if v_dim != dim or call.key[3] != dim:
        raise NoMatch(f"its keys and values have head dims {call.key[3]} and {v_dim}, its queries {dim}")
    projections = ("qkv_proj",) if hasattr(module, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    known = {*projections, "o_proj", "q_norm", "k_norm"}
    extra = sorted(n for n, _ in module.named_children() if n not in known)
    if extra:
        raise NoMatch(f"it has submodules bcg's fused attention does not know ({', '.join(extra)})")
    qk_norm, q_norm, k_norm = None, None, None
    if hasattr(module, "q_norm") or hasattr(module, "k_norm"):
        q_norm, k_norm = (norm_spec(getattr(module, n)) for n in ("q_norm", "k_norm"))
        sizes = (q_norm.weight.numel(), k_norm.weight.numel())
        qk_norm = "head" if sizes == (dim, dim) else "proj" if sizes == (heads * dim, kv_heads * dim) else None
        if qk_norm is None:
            raise NoMatch(f"its q/k norms have {sizes} weights, neither per head nor per projection")
        if qk_norm == "head" and q_norm.eps != k_norm.eps:
            raise NoMatch("its q and k norms have different eps")
    sinks = getattr(module, "sinks", None) if call.has_sinks else None
    layer_type = (getattr(config, "layer_types", None) or [None] * (call.layer_idx + 1))[call.layer_idx]
    for inv_freq, scaling in _rotary_tables(body, layer_type):
        try:
            rope = rope_layout(inv_freq, dim, scaling)
        except ValueError:
            continue
        scale = None if call.scaling == dim ** -0.5 else call.scaling
        yield AttentionSpec(projections, heads, kv_heads, dim, call.layer_idx, rope, qk_norm, q_norm, k_norm, scale,
                            call.sliding_window, call.softcap, sinks)


def _rotary_tables(body: nn.Module, layer_type: str | None) -> list[tuple[Tensor, float]]:
    """The (inv_freq, attention scaling) pairs the body's rotary embeddings hold, the layer type's own first."""
    tables = []
    for m in body.modules():
        if not type(m).__name__.endswith("RotaryEmbedding"):
            continue
        for name, buf in m.named_buffers(recurse=False):
            if not name.endswith("inv_freq") or "original" in name:
                continue
            prefix = name[: -len("inv_freq")]
            scaling = getattr(m, f"{prefix}attention_scaling", 1.0)
            first = layer_type is not None and prefix == f"{layer_type}_"
            tables.insert(0, (buf, float(scaling))) if first else tables.append((buf, float(scaling)))
    return tables


DIFFERS = "differs from the module as written by "
