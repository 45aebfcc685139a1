"""Shared experts run as routed experts: their weights stacked after the routed experts', every token routed to them.

An MoE block with shared experts (glm4_moe, the DeepSeek-V3 family) adds to the routed experts' weighted sum, for
every token, a gate/up MLP of intermediate size ``n * I`` (``moe_intermediate_size * n_shared_experts``). That MLP
is a sum over its intermediate columns, ``down(silu(gate x) * up x) = sum_j down[:, j] * silu(gate[j] x) * up[j] x``
(SiLU-and-multiply acts on each column alone), so its columns cut into ``n`` blocks of the routed experts' width
``I`` are ``n`` experts of the routed experts' shape whose outputs sum to the MLP's. :class:`StackedExperts` appends
them to the routed experts' stacked weights as experts ``E, ..., E + n - 1``, in the routed experts' layout (gate
and up halves or interleaved, ``(E, out, in)`` or transposed); the router emits them as ``n`` extra columns of weight
1 (``bcg::router_topk``'s ``num_shared``, after ``routed_scaling_factor``, which scales the routed weights only), so
the grouped GEMMs run them with the routed experts and the combine adds them in: no MLP of their own and no add.

The routed experts' parameters then view the stacked tensors (no second copy), and so do the shared MLP's where
their block of the stack is one strided view (one shared expert, the usual case); with several, the MLP's weights
keep their own storage too (a second copy of the shared experts only). :meth:`StackedExperts.split` gives every
parameter its own storage back (restore).

Example::

    problem = shared_problem(block.shared_experts, spec.experts)   # None: they can run as routed experts
    stack = StackedExperts(spec.experts, block.shared_experts)
    stack.gate_up.shape, stack.num_shared                          # (E + n, 2I, H), n
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bcg.models.hf.moe_experts import ExpertsSpec
from bcg.models.hf.patterns import is_silu, mlp_names

__all__ = ["StackedExperts", "shared_problem"]

STACKED_ACTIVATIONS = ("silu", "silu_interleaved")


def shared_problem(shared: nn.Module, experts: ExpertsSpec) -> str | None:
    """None where the gate/up MLP ``shared`` can run as experts of ``experts``' shape and activation, else why not
    (the load notes say it; the MLP then runs as its own module beside the routed experts)."""
    names = mlp_names(shared)
    if names is None:
        return "they are not a gate/up MLP of Linear layers"
    linears = [getattr(shared, n) for n in names]
    if any(linear.bias is not None for linear in linears):
        return "their projections have biases"
    if experts.activation not in STACKED_ACTIVATIONS or experts.gate_up_bias is not None \
            or experts.down_bias is not None:
        return "the routed experts are not bias-free SiLU-and-multiply experts"
    act = getattr(shared, "act_fn", None) or getattr(shared, "activation_fn", None)
    weight = linears[0].weight
    if not is_silu(act, weight):
        return "their activation is not SiLU"
    if any(lin.weight.dtype != experts.gate_up.dtype or lin.weight.device != experts.gate_up.device
           for lin in linears):
        return "their weights' dtype or device differs from the routed experts'"
    width, hidden = _width(experts), experts.down.shape[2 if experts.transposed else 1]
    inter, shared_hidden = linears[-1].weight.shape[1], weight.shape[1]
    if shared_hidden != hidden:
        return f"their hidden size {shared_hidden} is not the routed experts' {hidden}"
    if inter % width:
        return f"their intermediate size {inter} is not a multiple of the routed experts' {width}"
    return None


class StackedExperts:
    """The routed experts' ``gate_up`` and ``down`` with the shared experts' appended (see the module doc).

    Args:
        experts: the routed experts (their parameters: ``gate_up``/``down`` come to view the stack).
        shared: the shared experts' gate/up MLP, accepted by :func:`shared_problem`.
    """

    def __init__(self, experts: ExpertsSpec, shared: nn.Module) -> None:
        self.transposed, self.concatenated = experts.transposed, experts.activation == "silu"
        problem, names = shared_problem(shared, experts), mlp_names(shared)
        if problem is not None or names is None:
            raise ValueError(f"the shared experts cannot be stacked with the routed experts: {problem}")
        self.mlp_params = [getattr(shared, n).weight for n in names]
        self.width = _width(experts)
        self.num_shared = self.mlp_params[-1].shape[1] // self.width
        num_routed = experts.gate_up.shape[0]
        with torch.no_grad():
            gate_up, down = self._as_experts([p.detach() for p in self.mlp_params])
            self.gate_up = torch.cat([experts.gate_up.detach(), gate_up])
            self.down = torch.cat([experts.down.detach(), down])
            self.viewing: list[Tensor] = [experts.gate_up, experts.down]
            experts.gate_up.data, experts.down.data = self.gate_up[:num_routed], self.down[:num_routed]
            # The shared MLP's weights view their block of the stack where one strided view reaches them (one
            # shared expert); a reshape that had to copy keeps the MLP's own storage.
            stack = {t.untyped_storage().data_ptr() for t in (self.gate_up, self.down)}
            views = self._as_mlp(self.gate_up[num_routed:], self.down[num_routed:], len(self.mlp_params))
            for param, view in zip(self.mlp_params, views):
                if view.untyped_storage().data_ptr() in stack:
                    param.data = view
                    self.viewing.append(param)
        self.is_split = False

    def split(self) -> None:
        """Gives every parameter that views the stack its own storage again, contiguous (idempotent)."""
        if self.is_split:
            return
        with torch.no_grad():
            for param in self.viewing:
                param.data = param.data.clone(memory_format=torch.contiguous_format)
        self.is_split = True

    def _as_experts(self, mlp: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The MLP's weights (gate, up, down or gate_up, down) as ``n`` experts in the routed experts' layout."""
        n, width = self.num_shared, self.width
        gate, up = mlp[:2] if len(mlp) == 3 else mlp[0].chunk(2)
        hidden = gate.shape[1]
        halves = torch.stack([gate.reshape(n, width, hidden), up.reshape(n, width, hidden)], dim=1)  # (n, 2, I, H)
        gate_up = halves if self.concatenated else halves.transpose(1, 2)
        gate_up = gate_up.reshape(n, 2 * width, hidden)
        down = mlp[-1].reshape(hidden, n, width).permute(1, 0, 2)  # (n, H, I)
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up.contiguous(), down.contiguous()

    def _as_mlp(self, gate_up: Tensor, down: Tensor, parts: int) -> list[Tensor]:
        """The inverse of :meth:`_as_experts` by reshapes: views of the stack where strides allow, else copies."""
        n, width = self.num_shared, self.width
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        hidden = gate_up.shape[2]
        halves = (gate_up.view(n, 2, width, hidden) if self.concatenated
                  else gate_up.view(n, width, 2, hidden).transpose(1, 2))  # (n, 2, I, H): gate, up
        mlp_down = down.permute(1, 0, 2).reshape(hidden, n * width)
        if parts == 2:  # one gate_up projection: all gate rows, then all up rows
            return [halves.transpose(0, 1).reshape(2 * n * width, hidden), mlp_down]
        return [halves[:, 0].reshape(n * width, hidden), halves[:, 1].reshape(n * width, hidden), mlp_down]


def _width(experts: ExpertsSpec) -> int:
    """The routed experts' intermediate size ``I``."""
    return experts.down.shape[1 if experts.transposed else 2]
