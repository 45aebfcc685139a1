"""Fused stand-ins for a transformers decoder's RMSNorms, gate/up MLPs and decoder layers (attention: see
:mod:`bcg.models.hf.fused_attention`).

Each stand-in is built from the module it replaces, registers that module's own children and parameters under the
same names (the state dict does not change), keeps the original for :meth:`bcg.models.hf.fusion.Fusion.restore`,
answers any other attribute from it, and runs bcg's fused kernels (:mod:`bcg.ops.kernels`: Triton on CUDA with
``kernels="fused"``, their plain-torch references elsewhere). Which module may be replaced is decided by
:mod:`bcg.models.hf.fusion`, which checks every stand-in against the original on a recorded input.

* :class:`FusedRMSNorm`: ``w * x / rms(x)`` or gemma's ``(1 + w) * x / rms(x)`` (the kernel's weight is then the
  fp32 ``1 + w``, which gemma computes in fp32 too), one kernel.
* :class:`FusedMLP`: ``down(act(gate(x)) * up(x))`` with gate and up as one GEMM over their joined weights, and
  SiLU-and-multiply as one kernel when ``act`` is SiLU (any other activation runs as the module's own).
* :class:`FusedDecoderLayer`: the pre-norm layer ``h += attn(norm(h)); h += mlp(norm(h))`` with the residual add and
  the norm after it as one kernel, each sublayer's output optionally scaled first (granite's
  ``residual_multiplier``); ``"sandwich"`` (gemma2/3) also norms each sublayer's output before its add;
  ``"post_norm"`` (olmo2) norms only the sublayers' outputs, ``h += norm(attn(h)); h += norm(mlp(h))``.
  Consecutive pre-norm layers (and the last one with the final norm) also join a layer's last add with the next
  module's input norm (:func:`hand_off`), as the native models carry the residual.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.models.hf.joined import JoinedWeight
from bcg.models.layers import swiglu_fused
from bcg.ops import kernels as fused

__all__ = ["FusedDecoderLayer", "FusedMLP", "FusedModule", "FusedRMSNorm", "NoMatch", "NormHandoff", "NormSpec",
           "hand_off"]

# The kernels' plain-torch references run F.rms_norm with gemma's fp32 (1 + w) on half-precision rows, which is the
# arithmetic gemma does; torch notes at every such call that it cannot use its own fused CPU path for mixed dtypes.
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)


class NoMatch(Exception):
    """The module does not match a fused pattern exactly; the message says how."""


class FusedModule(nn.Module):
    """Base of the stand-ins: the original (not registered: its parameters are registered once, under their own
    names), the kernels implementation, and attribute reads the stand-in does not answer sent to the original."""

    kernels: str = "torch"

    def __init__(self, original: nn.Module, children: dict[str, nn.Module | nn.Parameter | None]) -> None:
        super().__init__()
        self.joined: list[JoinedWeight] = []
        # In the original's order (the state dict's), and before the original is set: registering checks that the
        # name is free, which the fallback to the original's attributes would deny.
        order = [n for n, _ in original.named_parameters(recurse=False)] + [n for n, _ in original.named_children()]
        for name in sorted(children, key=lambda n: order.index(n) if n in order else len(order)):
            if children[name] is not None:
                setattr(self, name, children[name])
        self.__dict__["original"] = original

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None:
                raise
            return getattr(original, name)

    def unjoin(self) -> None:
        """Gives the joined parameters their own storage back (restore)."""
        for joined in self.joined:
            joined.split()


class NormSpec:
    """How an RMSNorm module normalises: the kernel's weight (the module's own, or fp32 ``1 + w``) and its eps."""

    def __init__(self, module: nn.Module, offset: bool) -> None:
        self.module, self.offset = module, offset
        self.eps = float(norm_eps(module))
        self.weight = (1.0 + module.weight.detach().float()) if offset else module.weight

    def __call__(self, x: Tensor, impl: str) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps, impl=impl)


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon of an RMSNorm module (transformers names it ``variance_epsilon`` or ``eps``)."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


class NormHandoff:
    """A layer's last residual add and the next module's input norm as one kernel, across the decoder's loop.

    The layer before computes ``h = residual + mlp_out`` and ``norm(h)`` in one fused kernel, returns ``h`` (what the
    loop passes on) and leaves ``(h, norm(h))`` here; the module after takes the normed rows when its input is that
    very ``h`` (anything else, e.g. a hook's replacement, is normed afresh). Not while torch.compile traces: a
    compiled region runs one layer's code for every layer, and dynamo would guard on the pending tensors.
    """

    def __init__(self, norm: NormSpec) -> None:
        self.norm = norm
        self.pending: tuple[Tensor, Tensor] | None = None

    def give(self, mlp_out: Tensor, residual: Tensor, impl: str) -> Tensor:
        h = torch.empty_like(residual)
        normed, h = _add_norm(mlp_out, residual, self.norm, h, impl)
        self.pending = (h, normed)
        return h

    def take(self, hidden_states: Tensor, impl: str) -> Tensor:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] is hidden_states:
            return pending[1]
        return self.norm(hidden_states, impl)


class FusedRMSNorm(FusedModule):
    """An RMSNorm module on the fused kernel (see the module doc)."""

    def __init__(self, spec: NormSpec) -> None:
        super().__init__(spec.module, {"weight": spec.module.weight})
        self.spec = spec
        self.handoff: NormHandoff | None = None  # set when the decoder's last layer computes this norm

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not torch.compiler.is_compiling() and self.handoff is not None:
            return self.handoff.take(hidden_states, self.kernels)
        return self.spec(hidden_states, self.kernels)

    def unjoin(self) -> None:
        super().unjoin()
        self.handoff = None


class FusedMLP(FusedModule):
    """A gate/up MLP with one GEMM for gate and up (see the module doc).

    Args:
        original: the MLP module.
        names: its (gate, up, down) Linear children, or (gate_up, down) when gate and up are one already (phi3).
        act: the activation module, or None for SiLU (then one SiLU-and-multiply kernel).
    """

    def __init__(self, original: nn.Module, names: tuple[str, ...], act: nn.Module | None) -> None:
        children = {n: getattr(original, n) for n in names}
        super().__init__(original, children)
        self.down_name = names[-1]
        self.__dict__["act"] = act  # the original's (registered there), or None
        if len(names) == 3:
            gate, up = children[names[0]], children[names[1]]
            weight = JoinedWeight([gate.weight, up.weight])
            self.joined.append(weight)
            self.gate_up_weight = weight.tensor
            self.gate_up_bias = None
            if gate.bias is not None:
                bias = JoinedWeight([gate.bias, up.bias])
                self.joined.append(bias)
                self.gate_up_bias = bias.tensor
        else:
            self.gate_up_weight, self.gate_up_bias = children[names[0]].weight, children[names[0]].bias

    def forward(self, x: Tensor) -> Tensor:
        down = getattr(self, self.down_name)
        if self.act is None:
            return swiglu_fused(x, self.gate_up_weight, self.gate_up_bias, down, self.kernels)
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return down(self.act(gate) * up)


class FusedDecoderLayer(FusedModule):
    """A decoder layer whose residual adds ride the fused add + RMSNorm kernel (see the module doc).

    Args:
        original: the decoder layer.
        kind: ``"pre_norm"`` (llama: input and post-attention norms), ``"sandwich"`` (gemma2/3: also a norm after
            each sublayer and a pre-feedforward norm) or ``"post_norm"`` (olmo2: a norm after each sublayer only).
        norms: the layer's norms by child name.
        residual_scale: what each sublayer's output is multiplied by before its residual add (pre-norm only).
    """

    def __init__(self, original: nn.Module, kind: str, norms: dict[str, NormSpec],
                 residual_scale: float = 1.0) -> None:
        names = ["self_attn", "mlp", *norms]
        super().__init__(original, {n: getattr(original, n) for n in names})
        self.kind, self.norms, self.residual_scale = kind, norms, residual_scale
        # pre-norm layers chained by :func:`hand_off`: this layer's input norm, and the next module's
        self.handoff_in: NormHandoff | None = None
        self.handoff_out: NormHandoff | None = None

    def unjoin(self) -> None:
        super().unjoin()
        self.handoff_in = self.handoff_out = None

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        impl, n = self.kernels, self.norms
        if self.kind == "post_norm":  # the module's own order: norm of each sublayer's output, then its add
            attn_out = self.self_attn(hidden_states, *args, **kwargs)[0]
            h = hidden_states + n["post_attention_layernorm"](attn_out, impl)
            return h + n["post_feedforward_layernorm"](_first(self.mlp(h)), impl)
        # is_compiling first: dynamo must not read (and guard on) the handoffs, which differ between layers
        if not torch.compiler.is_compiling() and self.handoff_in is not None:
            normed_in = self.handoff_in.take(hidden_states, impl)
        else:
            normed_in = n["input_layernorm"](hidden_states, impl)
        attn_out = self.self_attn(normed_in, *args, **kwargs)[0]
        if self.residual_scale != 1.0:
            attn_out = attn_out * self.residual_scale
        # h = hidden + attn_out (rounded to the residual's dtype) and the next norm of h, in one kernel; the layer's
        # input is only read (it may be a graph's static input), attn_out is overwritten with the normed rows.
        residual = torch.empty_like(hidden_states)
        if self.kind == "sandwich":
            attn_out = n["post_attention_layernorm"](attn_out, impl)
            normed, residual = _add_norm(attn_out, hidden_states, n["pre_feedforward_layernorm"], residual, impl)
            return residual + n["post_feedforward_layernorm"](_first(self.mlp(normed)), impl)
        normed, residual = _add_norm(attn_out, hidden_states, n["post_attention_layernorm"], residual, impl)
        mlp_out = _first(self.mlp(normed))
        if self.residual_scale != 1.0:
            mlp_out = mlp_out * self.residual_scale
        if not torch.compiler.is_compiling() and self.handoff_out is not None:
            return self.handoff_out.give(mlp_out, residual, impl)
        return residual + mlp_out


def hand_off(layers: list[nn.Module], final_norm: nn.Module | None) -> int:
    """Chains consecutive fused pre-norm layers (``layers`` in the decoder's order, any module) and the final norm,
    so each layer's last residual add runs with the next module's input norm (:class:`NormHandoff`); returns how
    many adds were joined so."""
    joined = 0
    receivers = [*layers[1:], final_norm]
    for layer, receiver in zip(layers, receivers):
        if not (isinstance(layer, FusedDecoderLayer) and layer.kind == "pre_norm"):
            continue
        if isinstance(receiver, FusedDecoderLayer) and receiver.kind == "pre_norm":
            layer.handoff_out = receiver.handoff_in = NormHandoff(receiver.norms["input_layernorm"])
        elif isinstance(receiver, FusedRMSNorm):
            layer.handoff_out = receiver.handoff = NormHandoff(receiver.spec)
        else:
            continue
        joined += 1
    return joined


def _first(out: Tensor | tuple) -> Tensor:
    """An MLP's output (MoE blocks of some models also return their router's scores, which the layer drops)."""
    return out[0] if isinstance(out, tuple) else out


def _add_norm(x: Tensor, residual: Tensor, norm: NormSpec, residual_out: Tensor, impl: str) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    return fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps, residual_out=residual_out, impl=impl)
