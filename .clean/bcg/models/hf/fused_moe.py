"""A transformers mixture-of-experts block on bcg's expert kernels: the native MoE path's routing, expert order and
grouped GEMMs, with fixed shapes and no host read, so the whole block is captured in the graph segments.

:class:`FusedMoE` replaces a block made of a router (``gate`` or ``router``), stacked experts (``experts`` with 3-D
``gate_up_proj`` and ``down_proj``, optional biases) and optional shared experts (``shared_experts``, a gate/up MLP:
stacked after the routed experts as ``n`` more experts every token takes, :mod:`bcg.models.hf.moe_shared`; where
they cannot be, run as their own MLP and added). Per forward, as :class:`bcg.models.moe.MoEFFN` does:

1. the router's rule (:mod:`bcg.models.hf.moe_routing`): ``k`` expert ids and weights per token, then the ``n``
   shared experts' ids with weight 1;
2. :func:`bcg.ops.kernels.expert_order`: the ``T * (k + n)`` (token, choice) pairs in stable expert order with each
   expert's group end, one kernel; the hidden rows gathered in that order;
3. the gate/up and down projections as two ``F.grouped_mm`` over the stacked weights (the weights as stored: rows
   ``(E, out, in)`` for most families, ``(E, in, out)`` for gpt_oss), with the experts' biases gathered per row, and
   the activation between them: SiLU-and-multiply in one kernel (gate and up halves), or gpt_oss's clamped SwiGLU
   on interleaved gate/up columns (``(up + 1) * gate * sigmoid(alpha * gate)``, both clamped at ``limit``), the
   experts' gate/up bias added in the same kernel;
4. :func:`bcg.ops.kernels.moe_combine`: the k outputs of each token, weighted, summed in a fixed order in fp32.

Where ``grouped_mm`` does not run for the weights' device, dtype and layout (probed at load), each row's expert
matrix is gathered and multiplied by ``bmm``: exact, ``T * k`` weight copies of memory.

Example::

    block = model.model.layers[0].mlp                      # e.g. Qwen3MoeSparseMoeBlock
    fused = FusedMoE(block, spec)                          # spec: one of moe_specs(block, config)
    fused(hidden_states)                                   # the block's output, captured without a host read
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.models.hf.fused_layer import FusedModule, NoMatch
from bcg.models.hf.moe_experts import ExpertsSpec
from bcg.models.hf.moe_routing import NotARouter, RouterSpec, router_spec
from bcg.models.hf.moe_shared import StackedExperts, shared_problem
from bcg.models.hf.patterns import is_silu
from bcg.ops import kernels as fused
from bcg.ops.kernels import fused_available

__all__ = ["ExpertsSpec", "FusedMoE", "MoESpec", "is_moe_block", "moe_specs"]

ROUTER_NAMES = ("gate", "router")


@dataclass
class MoESpec:
    """What :class:`FusedMoE` needs: its router's and experts' specs, child names, output structure."""

    router_name: str
    router: RouterSpec
    experts: ExpertsSpec
    has_shared: bool
    returns_scores: bool  # the block returns (hidden, router weights) (gpt_oss), not hidden alone
    shared_problem: str | None = None  # why the shared experts run as their own MLP (None: stacked as experts)

    @property
    def stacks_shared(self) -> bool:
        """The shared experts run as experts of the grouped GEMMs (:mod:`bcg.models.hf.moe_shared`)."""
        return self.has_shared and self.shared_problem is None

    def describe(self) -> str:
        """The routing rule and the experts' activation, in words (the load notes')."""
        r, e = self.router, self.experts
        rule = {"softmax_topk": f"softmax then top-{r.top_k}" + (", renormalised" if r.renormalize else ""),
                "topk_softmax": f"top-{r.top_k} then softmax",
                "sigmoid_topk": f"sigmoid with a correction bias, top-{r.top_k}"
                                + (f" in the best {r.topk_group} of {r.n_group} groups" if r.n_group > 1 else "")
                                + (", renormalised" if r.renormalize else "")
                                + (f", scaled by {r.scaling:g}" if r.scaling != 1.0 else "")}[r.rule]
        act = {"silu": "SiLU-and-multiply", "silu_interleaved": "SiLU-and-multiply on interleaved gate/up",
               "clamped_swiglu": f"clamped SwiGLU (limit {e.limit:g}, alpha {e.alpha:g})"}[e.activation]
        biases = " with biases" if e.gate_up_bias is not None else ""
        shared = ""
        if self.stacks_shared:
            n = self.router.num_shared  # set by the stand-in, which splits the MLP into experts
            count = f"{n} more routed expert{'s' if n > 1 else ''}" if n else "more routed experts"
            shared = f", shared experts as {count} of weight 1"
        elif self.has_shared:
            shared = f", shared experts as their own MLP ({self.shared_problem})"
        return f"routing {rule}; experts {act}{biases}{shared}"


class FusedMoE(FusedModule):
    """An MoE block on bcg's expert kernels (see the module doc); called as the block it replaces."""

    def __init__(self, original: nn.Module, spec: MoESpec) -> None:
        names = [spec.router_name, "experts"] + (["shared_experts"] if spec.has_shared else [])
        super().__init__(original, {n: getattr(original, n) for n in names})
        self.stack: StackedExperts | None = None
        if spec.stacks_shared:  # the routed experts' parameters view the stack until unjoin()
            self.stack = StackedExperts(spec.experts, original.shared_experts)
            spec = replace(spec, experts=replace(spec.experts, gate_up=self.stack.gate_up, down=self.stack.down),
                           router=replace(spec.router, num_shared=self.stack.num_shared))
        self.spec = spec
        e = spec.experts
        x_dtype = e.gate_up.dtype
        self.use_grouped_mm = all(_grouped_mm_runs(e.matrix(w), x_dtype) for w in (e.gate_up, e.down))
        self.grouped_mm_traceable = self.use_grouped_mm and all(
            _grouped_mm_runs(e.matrix(w), x_dtype, meta=True) for w in (e.gate_up, e.down))

    def unjoin(self) -> None:
        """Gives the stacked experts' parameters their own storage back (restore)."""
        super().unjoin()
        if self.stack is not None:
            self.stack.split()

    def _use_grouped_mm(self) -> bool:
        # Traced by torch.compile where grouped_mm has no meta kernel for the dtype: the (exact) bmm fallback.
        return self.use_grouped_mm and (self.grouped_mm_traceable or not torch.compiler.is_compiling())

    def _mm(self, rows: Tensor, weight: Tensor, expert: Tensor, group_end: Tensor) -> Tensor:
        e = self.spec.experts
        if self._use_grouped_mm():
            return F.grouped_mm(rows, e.matrix(weight), offs=group_end)
        return torch.bmm(rows[:, None, :], e.matrix(weight)[expert]).squeeze(1)

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        spec, impl, e = self.spec, self.kernels, self.spec.experts
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = spec.router.route(x, impl)
        order = fused.expert_order(ids, e.gate_up.shape[0], impl=impl)  # the shared experts too, if stacked
        gate_up = self._mm(x[order.token_index], e.gate_up, order.expert, order.group_end)
        if e.activation == "clamped_swiglu":  # the experts' bias and gpt_oss's activation in one kernel
            act = fused.clamped_swiglu(gate_up, e.gate_up_bias, order.expert, e.alpha, e.limit, impl=impl)
        else:
            if e.gate_up_bias is not None:
                gate_up = gate_up + e.gate_up_bias[order.expert]
            act = e.activate(gate_up, impl)
        y_sorted = self._mm(act, e.down, order.expert, order.group_end)
        # The fused combine reads fp32 weights as they are; the reference multiplies in the rows' dtype.
        combine_weights = weights
        if weights.dtype != y_sorted.dtype and not (impl == "fused" and fused_available(y_sorted.device)):
            combine_weights = weights.to(y_sorted.dtype)
        # gpt-oss's down bias rides the combine (no gather and add of its own)
        bias = dict(bias=e.down_bias, row_expert=order.expert) if e.down_bias is not None else {}
        out = fused.moe_combine(y_sorted, order.slot, combine_weights, impl=impl, **bias).view(hidden_states.shape)
        if spec.has_shared and not spec.stacks_shared:
            out = out + self.shared_experts(hidden_states)
        return (out, weights[:, : spec.router.top_k]) if spec.returns_scores else out


# ------------------------------------------------------------------ which blocks match, and how
def is_moe_block(m: nn.Module) -> bool:
    """A router child and stacked experts (3-D ``gate_up_proj`` and ``down_proj``)."""
    experts = getattr(m, "experts", None)
    if isinstance(m, FusedModule) or not isinstance(experts, nn.Module):
        return False
    if not any(isinstance(getattr(m, n, None), nn.Module) for n in ROUTER_NAMES):
        return False
    return all(isinstance(getattr(experts, n, None), Tensor) and getattr(experts, n).ndim == 3
               for n in ("gate_up_proj", "down_proj"))


def moe_specs(block: nn.Module, config: Any) -> list[MoESpec]:
    """The stand-in specs that may compute ``block`` (usually one; several when its layout is ambiguous from the
    shapes), each to be checked against the block on its recorded input.

    Raises:
        NoMatch: the block has parts or a rule bcg's fused form does not know.
    """
    router_name = next(n for n in ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module))
    extra = sorted(n for n, _ in block.named_children() if n not in (router_name, "experts", "shared_experts"))
    if extra:
        raise NoMatch(f"it has submodules bcg's fused MoE does not know ({', '.join(extra)})")
    router, experts = getattr(block, router_name), block.experts
    top_k = _first_int(router, block, config, names=("top_k", "num_experts_per_tok"))
    renorm = next((o.norm_topk_prob for o in (router, block, config)
                   if isinstance(getattr(o, "norm_topk_prob", None), bool)), None)
    if getattr(experts, "has_gate", True) is False or getattr(experts, "has_post_expert_norm", False):
        raise NoMatch("its experts are not gate/up experts (no gate, or a norm after each expert)")
    dtype = experts.gate_up_proj.dtype
    try:
        route = router_spec(router, top_k, renorm, dtype)
    except NotARouter as e:
        raise NoMatch(str(e)) from None
    hidden = route.weight.shape[1]
    returns_scores = isinstance(_run_once(block, hidden, dtype), tuple)
    shared = getattr(block, "shared_experts", None)
    specs = [MoESpec(router_name, route, e, shared is not None, returns_scores,
                     None if shared is None else shared_problem(shared, e))
             for e in _experts_specs(experts, hidden)]
    if not specs:
        raise NoMatch("its experts' activation is neither SiLU-and-multiply nor gpt_oss's clamped SwiGLU")
    return specs


def _experts_specs(experts: nn.Module, hidden: int) -> list[ExpertsSpec]:
    gate_up, down = experts.gate_up_proj, experts.down_proj
    layouts = [t for t in (False, True) if (gate_up.shape[1 if t else 2], down.shape[2 if t else 1]) == (hidden,) * 2]
    if isinstance(getattr(experts, "is_transposed", None), bool):
        layouts = [t for t in layouts if t == experts.is_transposed]
    base = ExpertsSpec(gate_up, down, getattr(experts, "gate_up_proj_bias", None),
                       getattr(experts, "down_proj_bias", None), False, "silu")
    if isinstance(getattr(experts, "alpha", None), float) and isinstance(getattr(experts, "limit", None), float):
        acts = [replace(base, activation="clamped_swiglu", alpha=experts.alpha, limit=experts.limit)]
    elif is_silu(getattr(experts, "act_fn", None), gate_up):
        concat = getattr(experts, "is_concatenated", None)
        acts = [replace(base, activation=a) for a, c in (("silu", True), ("silu_interleaved", False))
                if concat is None or concat == c]
    else:
        acts = []
    apply_gate = getattr(experts, "_apply_gate", None)
    if callable(apply_gate):  # the experts' own activation decides between the candidates
        g = torch.Generator().manual_seed(0)
        probe = (torch.randn(8, gate_up.shape[1 if not layouts or not layouts[0] else 2], generator=g) * 4)
        probe = probe.to(gate_up.device, gate_up.dtype)
        with torch.inference_mode():
            want = apply_gate(probe)
            acts = [a for a in acts if torch.allclose(a.activate(probe, "torch").float(), want.float(),
                                                      rtol=1e-2, atol=1e-3)]
    return [replace(a, transposed=t) for t in layouts for a in acts]


def _first_int(*objs: Any, names: tuple[str, ...]) -> int:
    for name in names:
        for o in objs:
            if isinstance(getattr(o, name, None), int):
                return getattr(o, name)
    raise NoMatch(f"neither its router nor the config says how many experts a token takes ({', '.join(names)})")


def _run_once(block: nn.Module, hidden: int, dtype: torch.dtype) -> Any:
    """The block's output on two random tokens (its structure: a tensor, or a tuple with the router's weights)."""
    device = block.experts.gate_up_proj.device
    x = torch.randn(1, 2, hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    with torch.inference_mode():
        return block(x)


@functools.cache
def _probe_layout(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
                  meta: bool) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    dev = torch.device("meta") if meta else device
    num, k = 2, shape[1]  # two experts of the real layout: the kernels' rules are about dims and strides
    try:
        weight = torch.empty_strided((num, *shape[1:]), stride, device=dev, dtype=dtype)
        if not meta:
            weight.zero_()
        rows = torch.zeros(num, k, device=dev, dtype=dtype)
        offs = torch.arange(1, num + 1, device=dev, dtype=torch.int32)
        F.grouped_mm(rows, weight, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _grouped_mm_runs(matrix: Tensor, dtype: torch.dtype, meta: bool = False) -> bool:
    """Whether ``F.grouped_mm`` multiplies rows of ``dtype`` by a weight of ``matrix``'s shape and strides (probed
    once per layout on a zero weight of that layout; ``meta``: whether torch.compile can trace it)."""
    return _probe_layout(matrix.device, dtype, tuple(matrix.shape), tuple(matrix.stride()), meta)
