"""The layer stack compiled once by ``torch.compile``, for every backend that captures or runs it (``compile=``).

``compile_layers`` traces ``model.forward_layers`` with ``fullgraph=True`` and the token dimension dynamic, so one
trace serves every bucket and every eager batch. The islands reach the compiler as opaque custom ops
(:mod:`bcg.ops.custom_ops`) whose implementation is the ``@eager_on_graph`` function: when compiled code calls one
while a breakable graph is being captured, the call is a break, exactly as in uncompiled code. The compiled
wrapper's Python and dynamo's guards therefore run at capture only; a breakable replay launches segments and
islands and nothing else.

* ``"inductor"``: Inductor's fused kernels (CUDA; under the CPU graph emulation its C++ kernels would bypass the
  recorder, so graph backends refuse it there).
* ``"traced"``: dynamo's trace run as an FX graph, no code generated: the same path under the CPU emulation, so CI
  covers it. Island ops are called as the island functions directly, as a graph that runs islands itself should.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["COMPILERS", "CompiledLayers", "compile_layers"]

COMPILERS = ("inductor", "traced")


def _islands_direct(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A compile backend that generates no code: the traced graph as is, island ops replaced by their functions."""
    from bcg.ops.custom_ops import is_island_node, island_fn

    for node in gm.graph.nodes:
        if is_island_node(node):
            node.target = island_fn(node)
    gm.recompile()
    return gm.forward


class CompiledLayers:
    """``model.forward_layers`` compiled with ``compiler``; call it as the uncompiled method.

    The first call marks the token dimension dynamic and compiles (:attr:`num_calls` says whether it happened);
    later calls of any size reuse the trace.

    Example::

        layers = compile_layers(model, "inductor")
        with forward_context(batch.to_context(16)):
            hidden = layers(static_hidden[:16], static_positions[:16])     # compiles once
    """

    def __init__(self, model: torch.nn.Module, compiler: str) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"compile must be one of {', '.join(COMPILERS)} (or None), got {compiler!r}")
        import bcg.ops.custom_ops  # noqa: F401 - registers the islands' ops and tracing stand-ins

        self.compiler = compiler
        backend = "inductor" if compiler == "inductor" else _islands_direct
        self._fn = torch.compile(_private_forward(model), fullgraph=True, backend=backend)
        self.num_calls = 0

    def __call__(self, hidden: Tensor, positions: Tensor) -> Tensor:
        if self.num_calls == 0:
            torch._dynamo.mark_dynamic(hidden, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        self.num_calls += 1
        return self._fn(hidden, positions)


def compile_layers(model: torch.nn.Module, compiler: str) -> CompiledLayers:
    """``model.forward_layers`` compiled with ``compiler`` ("inductor" or "traced"); see :class:`CompiledLayers`."""
    return CompiledLayers(model, compiler)


def _private_forward(model: torch.nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """``model.forward_layers`` as a function with a code object of its own.

    Dynamo keeps compiled code and guards per code object; one copy per engine keeps engines in one process from
    evaluating each other's guards at every call and from sharing one recompile limit.
    """

    def forward_layers(hidden: Tensor, positions: Tensor) -> Tensor:
        return model.forward_layers(hidden, positions)

    return types.FunctionType(forward_layers.__code__.replace(), forward_layers.__globals__, forward_layers.__name__,
                              forward_layers.__defaults__, forward_layers.__closure__)
