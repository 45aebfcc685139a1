"""Load-time fusion of a transformers decoder, driven by what its modules and config expose, checked module by module.

:func:`fuse` finds, in the decoder body, the modules that match a pattern bcg has a fused form for:

* attention modules with q/k/v projections (or one qkv projection), an output projection, optional q/k RMSNorms and
  sinks, RoPE from the body's rotary embedding (its ``inv_freq`` buffers): :class:`~.fused_attention.FusedAttention`;
* gate/up MLPs (``gate_proj``/``up_proj``/``down_proj`` or ``gate_up_proj``/``down_proj`` and an activation):
  :class:`~.fused_layer.FusedMLP`;
* mixture-of-experts blocks (a router of a known rule, stacked gate/up experts, optional shared experts, which run
  as more stacked experts where they can, else as their own MLP): :class:`~.fused_moe.FusedMoE`;
* RMSNorm modules, ``w * x / rms(x)`` or ``(1 + w) * x / rms(x)`` (decided numerically):
  :class:`~.fused_layer.FusedRMSNorm`;
* decoder layers of exactly the pre-norm or the sandwich structure: :class:`~.fused_layer.FusedDecoderLayer`

(the patterns are :mod:`bcg.models.hf.patterns`). One probe forward records every candidate's input and output as
written; each stand-in is then swapped in and run on its module's recorded input, and kept only if its output
matches the original's (:func:`~bcg.models.hf.patterns.compare`, a rounding tolerance by dtype). A module that does
not match a pattern exactly, or whose stand-in differs, is left as written and the reason is
recorded (:attr:`Fusion.notes`, which the engine copies into ``telemetry.notes``). Weights are joined once and the
original parameters view the joined tensors (:mod:`bcg.models.hf.joined`); :meth:`Fusion.restore` swaps every
original back and gives its parameters their own storage again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from bcg.errors import first_line
from bcg.models.hf.fused_attention import FusedAttention
from bcg.models.hf.fused_layer import FusedModule, FusedRMSNorm, hand_off
from bcg.models.hf.fused_moe import FusedMoE, is_moe_block, moe_specs
from bcg.models.hf.moe_ties import MoEInputs, near_tie_rows
from bcg.models.hf.patterns import (
    DIFFERS,
    TOLERANCE,
    NoMatch,
    attention_specs,
    compare,
    decoder_layers,
    is_attention,
    is_norm,
    make_layer,
    make_mlp,
    mlp_names,
    norm_spec,
)
from bcg.ops.kernels import fused_available
from bcg.tensors import tensor_leaves

__all__ = ["Fusion", "fuse"]

logger = logging.getLogger("bcg")


@dataclass
class Fusion:
    """What :func:`fuse` swapped (``(parent, name, original, stand-in)``, in order) and said."""

    swaps: list[tuple[nn.Module, str, nn.Module, FusedModule]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tie_tokens: Counter[str] = field(default_factory=Counter)  # per module class: tokens left out at routing ties

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
    layers = decoder_layers(body, config)
    attentions = {m: calls[m.layer_idx] for m in body.modules() if is_attention(m, calls, skip_layers)}
    mlps = [m for m in body.modules() if mlp_names(m) is not None]
    moes = [m for m in body.modules() if is_moe_block(m)]
    norms = [m for m in body.modules() if is_norm(m)]
    recorded = _record(list(attentions) + mlps + moes + norms + layers, one_request)
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
        moe_rules: Counter[str] = Counter()
        stacked: set[nn.Module] = set()  # shared experts that run inside their fused MoE block's grouped GEMMs
        for module in moes:  # before the MLPs: a block may take its shared experts' weights as stored
            why = _swap_moe(module, config, parents[module], recorded, fusion)
            if why is None:
                done["moe"] += 1
                stand_in = fusion.swaps[-1][3]
                moe_rules[f"{type(module).__name__}: {stand_in.spec.describe()}"] += 1
                if stand_in.spec.stacks_shared:
                    stacked.add(stand_in.shared_experts)
            else:
                left.append((type(module).__name__, why))
        # A fused MoE block is now the parent of its shared experts (where it runs them as their own MLP).
        parents = {child: (parent, name) for parent in body.modules() for name, child in parent.named_children()}
        for module in mlps:
            if module in stacked:
                continue
            why = _swap(parents[module], module, lambda m=module: make_mlp(m), recorded, fusion)
            done["mlp"] += why is None
            if why is not None:
                left.append((type(module).__name__, why))
        inside = {n for m in fused_attention for n in m.modules()}
        for module in norms:
            if module in inside:
                continue
            why = _swap(parents[module], module, lambda m=module: FusedRMSNorm(norm_spec(m)), recorded, fusion)
            done["norm"] += why is None
            if why is not None:
                left.append((type(module).__name__, why))
        for module in layers:
            why = _swap(parents[module], module, lambda m=module: make_layer(m), recorded, fusion)
            done["layer"] += why is None
            if why is not None:
                left.append((type(module).__name__, why))
        # Each checked alone above; chained, a layer's last add runs with the next module's input norm.
        done["handoff"] = hand_off([getattr(*parents[m]) for m in layers], getattr(body, "norm", None))
    fusion.notes = _notes(done, left)
    fusion.notes[1:1] = [f"fused MoE blocks: {n} {rule}" for rule, n in moe_rules.items()] + [
        f"fused {cls} although {n} probe tokens took another expert at a routing near-tie (scores within rounding)"
        for cls, n in fusion.tie_tokens.items()]
    for note in fusion.notes:
        logger.info("bcg: %s", note)
    return fusion


# ------------------------------------------------------------------ finding candidates
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
    except NoMatch as e:
        return str(e)
    # Checked with the kernels it will run by default: Triton where it runs (an impl it cannot launch fails here).
    device = next(iter(stand_in.parameters()), torch.empty(0)).device
    stand_in.kernels = "fused" if fused_available(device) else "torch"
    parent, name = where
    setattr(parent, name, stand_in)
    args, kwargs, want = recorded[module]
    try:
        with MoEInputs(stand_in) as seen:
            got = stand_in(*_clone(args), **_clone(kwargs))
        why = compare(got, want)
        if why is not None:  # allowed only on tokens a near-tie routed to other experts (moe_ties)
            ties = near_tie_rows(seen, lambda m: recorded.get(m, ((None,),))[0][0], _tolerance(want))
            if ties is not None and compare(got, want, skip_rows=ties) is None:
                why = None
                fusion.tie_tokens[type(module).__name__] += int(ties.sum())
    except Exception as e:  # a stand-in that cannot run this module's call is not a match
        why = f"its fused form failed on the module's own input ({first_line(e)})"
    if why is None:
        fusion.swaps.append((parent, name, module, stand_in))
        return None
    setattr(parent, name, module)
    stand_in.unjoin()
    return why


def _swap_attention(module: nn.Module, call: Any, config: Any, body: nn.Module, where: tuple[nn.Module, str],
                    recorded: Recorded, fusion: Fusion) -> str | None:
    try:
        specs = list(attention_specs(module, call, config, body))
    except NoMatch as e:
        return str(e)
    why = "no rotary embedding of the model matches its RoPE"
    for spec in specs:  # one per candidate rotary table; the first whose output matches is kept
        why = _swap(where, module, lambda s=spec: FusedAttention(module, s), recorded, fusion)
        if why is None:
            return None
    return why


def _tolerance(want: Any) -> float:
    leaves = [t for t in tensor_leaves(want) if t.is_floating_point()]
    return TOLERANCE.get(leaves[0].dtype, 1e-5) if leaves else 0.0


def _swap_moe(module: nn.Module, config: Any, where: tuple[nn.Module, str], recorded: Recorded,
              fusion: Fusion) -> str | None:
    try:
        specs = moe_specs(module, config)
    except NoMatch as e:
        return str(e)
    why = ""
    for spec in specs:  # one per layout the shapes leave open; the first whose output matches is kept
        why = _swap(where, module, lambda s=spec: FusedMoE(module, s), recorded, fusion)
        if why is None:
            return None
    return why


def _notes(done: Counter[str], left: list[tuple[str, str]]) -> list[str]:
    words = {"attention": "attention modules (one q/k/v GEMM, q/k norm where present and RoPE in one kernel)",
             "mlp": "MLPs (one gate/up GEMM, SiLU-and-multiply in one kernel where the activation is SiLU)",
             "moe": "MoE blocks (bcg's router, expert order and combine kernels, the experts as two grouped GEMMs)",
             "norm": "RMSNorms (one kernel)", "layer": "decoder layers (residual add and RMSNorm in one kernel)",
             "handoff": "layer ends (the last residual add with the next module's input RMSNorm in one kernel)"}
    notes = []
    if done:
        notes.append("fused at load: " + ", ".join(f"{done[k]} {words[k]}" for k in words if done[k]))
    # One line per class and reason; measured differences are grouped under the largest.
    grouped: dict[tuple[str, str], list[str]] = {}
    for cls, why in left:
        head, _, measured = why.partition(DIFFERS)
        grouped.setdefault((cls, head), []).append(measured)
    for (cls, head), measured in grouped.items():
        n = len(measured)
        why = head if not measured[0] else f"{head}{DIFFERS}up to {max(measured, key=_relative)}"
        notes.append(f"left as written: {cls} ({n} module{'s' if n > 1 else ''}): {why}")
    return notes



def _relative(measured: str) -> float:
    return float(measured.split(" ")[0])
