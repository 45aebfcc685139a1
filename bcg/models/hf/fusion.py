"""Load-time fusion of a transformers decoder, driven by what its modules and config expose, checked module by module.

:func:`fuse` finds, in the decoder body, the modules that match a pattern bcg has a fused form for:

* attention modules with q/k/v projections (or one qkv projection), an output projection, optional q/k RMSNorms and
  sinks, RoPE from the body's rotary embedding (its ``inv_freq`` buffers): :class:`~.fused_attention.FusedAttention`;
* gate/up MLPs (``gate_proj``/``up_proj``/``down_proj`` or ``gate_up_proj``/``down_proj`` and an activation):
  :class:`~.fused.FusedMLP`;
* RMSNorm modules, ``w * x / rms(x)`` or ``(1 + w) * x / rms(x)`` (decided numerically): :class:`~.fused.FusedRMSNorm`;
* decoder layers of exactly the pre-norm or the sandwich structure: :class:`~.fused.FusedDecoderLayer`.

One probe forward records every candidate's input and output as written; each stand-in is then swapped in and run
on its module's recorded input, and kept only if its output matches the original's (:data:`TOLERANCE`, by dtype).
A module that does not match a pattern exactly, or whose stand-in differs, is left as written and the reason is
recorded (:attr:`Fusion.notes`, which the engine copies into ``telemetry.notes``). Weights are joined once and the
original parameters view the joined tensors (:mod:`bcg.models.hf.joined`); :meth:`Fusion.restore` swaps every
original back and gives its parameters their own storage again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.errors import first_line
from bcg.models.hf.fused import FusedDecoderLayer, FusedMLP, FusedModule, FusedRMSNorm, NormSpec, norm_eps
from bcg.models.hf.fused_attention import AttentionSpec, FusedAttention, rope_layout
from bcg.tensors import tensor_leaves

__all__ = ["TOLERANCE", "Fusion", "fuse"]

logger = logging.getLogger("bcg")
# Largest difference a stand-in may show against the module it replaces, relative to the output's largest value:
# rounding only (the kernels round once where some modules round twice), far below what a wrong structure gives.
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 4e-3}
_LAYER_KINDS = {
    frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}): "pre_norm",
    frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp",
               "post_feedforward_layernorm"}): "sandwich",
}


@dataclass
class Fusion:
    """What :func:`fuse` swapped (``(parent, name, original, stand-in)``, in order) and said."""

    swaps: list[tuple[nn.Module, str, nn.Module, FusedModule]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set_kernels(self, impl: str) -> None:
        for *_, stand_in in self.swaps:
            stand_in.kernels = impl

    def restore(self) -> None:
        """Puts every original module back and gives its parameters their own storage (idempotent)."""
        for parent, name, original, stand_in in reversed(self.swaps):
            setattr(parent, name, original)
            stand_in.unjoin()
        self.swaps.clear()


Recorded = dict[nn.Module, tuple[tuple, dict, Any]]


def fuse(body: nn.Module, config: Any, calls: dict[int, Any], skip_layers: set[int],
         one_request: Callable[[], AbstractContextManager[Callable[[], None]]]) -> Fusion:
    """Fuses what matches in ``body`` (see the module doc).

    Args:
        body: the decoder body (``model.get_decoder()``), already running bcg's attention.
        config: the model's config.
        calls: the probe's :class:`~bcg.models.hf.attention.AttentionCall` per layer index.
        skip_layers: layers whose attention runs as a module island (DSA): left as written.
        one_request: a context manager yielding a function that runs the body once on a fixed random request.
    """
    fusion = Fusion()
    layers = _decoder_layers(body, config)
    attentions = {m: calls[m.layer_idx] for m in body.modules() if _is_attention(m, calls, skip_layers)}
    mlps = [m for m in body.modules() if _mlp_names(m) is not None]
    norms = [m for m in body.modules() if _is_norm(m)]
    recorded = _record(list(attentions) + mlps + norms + layers, one_request)
    left: list[tuple[str, str]] = []  # (module class, reason)
    done: Counter[str] = Counter()
    parents = {child: (parent, name) for parent in body.modules() for name, child in parent.named_children()}
    with torch.inference_mode(), one_request():
        fused_attention = set()
        for module, call in attentions.items():
            why = _swap_attention(module, call, config, body, parents[module], recorded, fusion)
            if why is None:
                fused_attention.add(module)
                done["attention"] += 1
            else:
                left.append((type(module).__name__, why))
        for module in mlps:
            why = _swap(parents[module], module, lambda m=module: _make_mlp(m), recorded, fusion)
            done["mlp"] += why is None
            if why is not None:
                left.append((type(module).__name__, why))
        inside = {n for m in fused_attention for n in m.modules()}
        for module in norms:
            if module in inside:
                continue
            why = _swap(parents[module], module, lambda m=module: FusedRMSNorm(_norm_spec(m)), recorded, fusion)
            done["norm"] += why is None
            if why is not None:
                left.append((type(module).__name__, why))
        for module in layers:
            why = _swap(parents[module], module, lambda m=module: _make_layer(m), recorded, fusion)
            done["layer"] += why is None
            if why is not None:
                left.append((type(module).__name__, why))
    fusion.notes = _notes(done, left)
    for note in fusion.notes:
        logger.info("bcg: %s", note)
    return fusion


# ------------------------------------------------------------------ finding candidates
def _decoder_layers(body: nn.Module, config: Any) -> list[nn.Module]:
    layers = getattr(body, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == config.num_hidden_layers:
        return list(layers)
    return []


def _is_attention(m: nn.Module, calls: dict[int, Any], skip: set[int]) -> bool:
    idx = getattr(m, "layer_idx", None)
    if not isinstance(idx, int) or idx in skip or idx not in calls or calls[idx].module != type(m).__name__:
        return False
    names = ("qkv_proj",) if isinstance(getattr(m, "qkv_proj", None), nn.Linear) else ("q_proj", "k_proj", "v_proj")
    return all(type(getattr(m, n, None)) is nn.Linear for n in (*names, "o_proj"))


def _mlp_names(m: nn.Module) -> tuple[str, ...] | None:
    children = dict(m.named_children())
    for names in (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj")):
        if all(type(children.get(n)) is nn.Linear for n in names):
            extra = set(children) - set(names) - {"act_fn", "activation_fn"}
            return None if extra else names
    return None


def _is_norm(m: nn.Module) -> bool:
    params = dict(m.named_parameters(recurse=False))
    return ("rmsnorm" in type(m).__name__.lower() and not list(m.children()) and list(params) == ["weight"]
            and params["weight"].ndim == 1 and norm_eps(m) is not None)


def _record(modules: list[nn.Module], one_request: Callable) -> Recorded:
    """Every module's first input and output on one forward of the model as written (tensors cloned)."""
    recorded: Recorded = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if module not in recorded:
            recorded[module] = _clone((args, kwargs, output))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.inference_mode(), one_request() as run:
            run()
    finally:
        for h in handles:
            h.remove()
    return recorded


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_clone(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------ swapping and checking
def _swap(where: tuple[nn.Module, str], module: nn.Module, make: Callable[[], FusedModule], recorded: Recorded,
          fusion: Fusion) -> str | None:
    """Builds the stand-in, swaps it in and checks it on the recorded input; None if kept, else why not."""
    if module not in recorded:
        return "it did not run in the probe forward"
    try:
        stand_in = make()
    except _NoMatch as e:
        return str(e)
    parent, name = where
    setattr(parent, name, stand_in)
    args, kwargs, want = recorded[module]
    try:
        got = stand_in(*_clone(args), **_clone(kwargs))
        why = _compare(got, want)
    except Exception as e:  # a stand-in that cannot run this module's call is not a match
        why = f"its fused form failed on the module's own input ({first_line(e)})"
    if why is None:
        fusion.swaps.append((parent, name, module, stand_in))
        return None
    setattr(parent, name, module)
    stand_in.unjoin()
    return why


def _compare(got: Any, want: Any) -> str | None:
    got_t, want_t = tensor_leaves(got), tensor_leaves(want)
    if len(got_t) != len(want_t) or any(a.shape != b.shape for a, b in zip(got_t, want_t)):
        return "its fused form returns another structure than the module"
    for a, b in zip(got_t, want_t):
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return "its fused form returns other values"
            continue
        rel = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        if not rel <= TOLERANCE.get(b.dtype, 1e-5):
            return f"its fused form {_DIFFERS}{rel:.2g} (relative)"
    return None


class _NoMatch(Exception):
    """The module does not match the fused pattern exactly; the message says how."""


def _norm_spec(module: nn.Module) -> NormSpec:
    """Which RMSNorm the module computes, decided on a random input: ``w`` or ``1 + w`` as the scale."""
    if isinstance(module, FusedRMSNorm):
        return module.spec
    w = module.weight
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype) * 3
    with torch.inference_mode():
        want = module(x)
        for offset in (False, True):
            spec = NormSpec(module, offset)
            if _compare(spec(x, "torch"), want) is None:
                return spec
    raise _NoMatch("it is not w * x / rms(x) nor (1 + w) * x / rms(x)")


def _make_mlp(module: nn.Module) -> FusedMLP:
    names = _mlp_names(module)
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    if names is None or act is None:
        raise _NoMatch("it is not a gate/up MLP with an activation")
    gate = getattr(module, names[0])
    if len(names) == 3 and (gate.bias is None) != (getattr(module, names[1]).bias is None):
        raise _NoMatch("only one of its gate and up projections has a bias")
    x = torch.linspace(-6, 6, 97, device=gate.weight.device, dtype=gate.weight.dtype)
    with torch.inference_mode():
        is_silu = torch.equal(act(x), F.silu(x))
    return FusedMLP(module, names, None if is_silu else act)


def _make_layer(module: nn.Module) -> FusedDecoderLayer:
    # Dropout is the identity in eval mode (phi3's residual dropouts); anything else must be a known sublayer.
    names = frozenset(n for n, c in module.named_children() if not (isinstance(c, nn.Dropout) and not c.training))
    kind = _LAYER_KINDS.get(names)
    if kind is None:
        raise _NoMatch(f"its sublayers ({', '.join(sorted(names))}) are neither the pre-norm nor the sandwich layout")
    scales = {k: v for k, v in vars(module).items() if isinstance(v, float) and ("multiplier" in k or "scal" in k)}
    if any(v != 1.0 for v in scales.values()):
        raise _NoMatch(", ".join(f"{k}={v}" for k, v in scales.items()) + " scales its sublayers' outputs")
    norms = {}
    for n in sorted(names):
        if n.endswith("layernorm"):
            child = getattr(module, n)
            if not isinstance(child, FusedRMSNorm):
                raise _NoMatch(f"its {n} is not an RMSNorm bcg fused")
            norms[n] = child.spec
    return FusedDecoderLayer(module, kind, norms)


def _swap_attention(module: nn.Module, call: Any, config: Any, body: nn.Module, where: tuple[nn.Module, str],
                    recorded: Recorded, fusion: Fusion) -> str | None:
    try:
        specs = list(_attention_specs(module, call, config, body))
    except _NoMatch as e:
        return str(e)
    why = "no rotary embedding of the model matches its RoPE"
    for spec in specs:  # one per candidate rotary table; the first whose output matches is kept
        why = _swap(where, module, lambda s=spec: FusedAttention(module, s), recorded, fusion)
        if why is None:
            return None
    return why


def _attention_specs(module: nn.Module, call: Any, config: Any, body: nn.Module) -> Iterator[AttentionSpec]:
    _, heads, _, dim = call.query
    kv_heads, v_dim = call.key[1], call.value[3]
    if v_dim != dim or call.key[3] != dim:
        raise _NoMatch(f"its keys and values have head dims {call.key[3]} and {v_dim}, its queries {dim}")
    projections = ("qkv_proj",) if hasattr(module, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    known = {*projections, "o_proj", "q_norm", "k_norm"}
    extra = sorted(n for n, _ in module.named_children() if n not in known)
    if extra:
        raise _NoMatch(f"it has submodules bcg's fused attention does not know ({', '.join(extra)})")
    qk_norm, q_norm, k_norm = None, None, None
    if hasattr(module, "q_norm") or hasattr(module, "k_norm"):
        q_norm, k_norm = (_norm_spec(getattr(module, n)) for n in ("q_norm", "k_norm"))
        sizes = (q_norm.weight.numel(), k_norm.weight.numel())
        qk_norm = "head" if sizes == (dim, dim) else "proj" if sizes == (heads * dim, kv_heads * dim) else None
        if qk_norm is None:
            raise _NoMatch(f"its q/k norms have {sizes} weights, neither per head nor per projection")
        if qk_norm == "head" and q_norm.eps != k_norm.eps:
            raise _NoMatch("its q and k norms have different eps")
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


def _notes(done: Counter[str], left: list[tuple[str, str]]) -> list[str]:
    words = {"attention": "attention modules (one q/k/v GEMM, q/k norm where present and RoPE in one kernel)",
             "mlp": "MLPs (one gate/up GEMM, SiLU-and-multiply in one kernel where the activation is SiLU)",
             "norm": "RMSNorms (one kernel)", "layer": "decoder layers (residual add and RMSNorm in one kernel)"}
    notes = []
    if done:
        notes.append("fused at load: " + ", ".join(f"{done[k]} {words[k]}" for k in words if done[k]))
    # One line per class and reason; measured differences are grouped under the largest.
    grouped: dict[tuple[str, str], list[str]] = {}
    for cls, why in left:
        head, _, measured = why.partition(_DIFFERS)
        grouped.setdefault((cls, head), []).append(measured)
    for (cls, head), measured in grouped.items():
        n = len(measured)
        why = head if not measured[0] else f"{head}{_DIFFERS}up to {max(measured, key=_relative)}"
        notes.append(f"left as written: {cls} ({n} module{'s' if n > 1 else ''}): {why}")
    return notes


_DIFFERS = "differs from the module as written by "


def _relative(measured: str) -> float:
    return float(measured.split(" ")[0])
