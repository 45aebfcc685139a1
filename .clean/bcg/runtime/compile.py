"""The layer stack compiled by ``torch.compile`` one layer at a time ("regional compilation"), for every backend that
captures or runs it (``compile=``).

:class:`CompiledLayers` runs ``model.forward_layers`` as written, with each layer handed to one compiled function
(:func:`bcg.models.regions.run_layer`): dynamo traces a layer, lifts its weights to graph inputs and reuses the graph
for every later layer of the same structure, so compile time does not grow with depth; a model whose layers differ
(a first layer without a residual, sliding and full attention, dense and MoE layers) compiles once per distinct
structure. The layer's islands are the region islands (:mod:`bcg.ops.region_islands`): their layer index comes from
the loop when they run, not from the trace. The token dimension is dynamic, so one trace serves every bucket and
every eager batch. The islands reach the compiler as opaque custom ops whose implementation is the
``@eager_on_graph`` function: when compiled code calls one while a breakable graph is being captured, the call is a
break, exactly as in uncompiled code, and the compiled wrapper's Python and dynamo's guards run at capture only.

* ``"inductor"``: Inductor's fused kernels (CUDA; under the CPU graph emulation its C++ kernels would bypass the
  recorder, so graph backends refuse it there).
* ``"traced"``: dynamo's trace run as an FX graph, no code generated: the same path under the CPU emulation, so CI
  covers it. Island ops are called as the island functions directly, as a graph that runs islands itself should.

When dynamo cannot trace a layer, the first call raises :class:`CompileRefused` with one line naming the layer, the
reason and the fix; dynamo's own log of the attempt is kept out of the terminal (``BCG_COMPILE_LOG=1`` shows it).
"""

from __future__ import annotations

import itertools
import logging
import re
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from bcg import env
from bcg.errors import first_line
from bcg.models.regions import REGION_FLAG, regional
from bcg.ops.context import LayerIds
from bcg.ops.region_islands import at_layer
from bcg.runtime.weak_backend import compile_owned
from bcg.tensors import tensor_leaves

__all__ = ["COMPILERS", "CompileRefused", "CompiledLayers", "compile_layers", "quiet_compile"]

COMPILERS = ("inductor", "traced")
logger = logging.getLogger("bcg")
# The loggers a failed (or successful) trace writes to; quiet unless BCG_COMPILE_LOG is set.
_COMPILER_LOGGERS = ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes", "torch._guards",
                     "torch._functorch", "torch._subclasses", "torch.__trace")


class CompileRefused(RuntimeError):
    """torch.compile cannot trace a layer; the message's first line names the layer, the reason and the fix."""


@contextmanager
def quiet_compile() -> Iterator[None]:
    """Inside the block the compiler's loggers print errors only (unless ``BCG_COMPILE_LOG=1``): a failed trace is
    reported by bcg in one line, not by dynamo's log of the attempt."""
    if env.COMPILE_LOG:
        yield
        return
    loggers = [logging.getLogger(name) for name in _COMPILER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _islands_direct(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A compile backend that generates no code: the traced graph as is, island ops replaced by their functions."""
    from bcg.ops.custom_ops import is_island_node, island_fn

    for node in gm.graph.nodes:
        if is_island_node(node):
            node.target = island_fn(node)
    gm.recompile()
    return gm.forward


class CompiledLayers:
    """``model.forward_layers`` with every layer run by one compiled function; call it as the uncompiled method.

    The first call marks the token dimension dynamic and compiles each distinct layer structure it meets
    (:attr:`num_graphs` counts them, :attr:`num_calls` says whether it happened, :attr:`ops` counts the custom ops
    the traced graphs call by name, e.g. ``"bcg.rms_norm"``: which fused kernels and islands the compiled layers
    run); later calls of any size reuse the graphs.

    Raises:
        CompileRefused: (first call) dynamo cannot trace a layer; the message says which, why, and what to do.

    Example::

        layers = compile_layers(model, "inductor")
        with forward_context(batch.to_context(16)):
            hidden = layers(hidden[:16], positions[:16])        # compiles one layer per structure
        layers.num_graphs                                                  # e.g. 2 (the first layer, the rest)
    """

    def __init__(self, model: torch.nn.Module, compiler: str) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"compile must be one of {', '.join(COMPILERS)} (or None), got {compiler!r}")
        import bcg.ops.custom_ops  # noqa: F401 - registers the islands' ops and tracing stand-ins

        self.model, self.compiler = model, compiler
        self.num_calls = self.num_graphs = 0
        self.ops: Counter[str] = Counter()
        self._fn = compile_owned(_private_region(), self, self._compile, fullgraph=True)
        self._num_tokens: int | None = None  # set during the first call: its token count is marked dynamic

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The backend (dynamo holds it weakly: :class:`~bcg.runtime.weak_backend.WeakBackend`)."""
        self.num_graphs += 1
        self.ops.update(_custom_ops(gm))
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return _islands_direct(gm, example_inputs)

    def __call__(self, hidden: Tensor, positions: Tensor) -> Tensor:
        first = self.num_calls == 0
        self.num_calls += 1
        if not first:
            with regional(self._run):
                return self.model.forward_layers(hidden, positions)
        self._num_tokens = hidden.shape[0]
        try:
            with quiet_compile(), regional(self._run):
                out = self.model.forward_layers(hidden, positions)
        finally:
            self._num_tokens = None
        if self.num_graphs == 0:
            raise CompileRefused(f"torch.compile compiled nothing: {type(self.model).__name__}'s layers do not run "
                                 "through bcg.models.regions.run_layer (its layer loop, or body.layers for a "
                                 "transformers model). Fix: run without compile=")
        logger.info("bcg: compile=%r traced %d layer graph(s) for %d layers", self.compiler, self.num_graphs,
                    self.model.config.num_layers)
        return out

    def _run(self, layer: torch.nn.Module, ids: LayerIds, args: tuple, kwargs: dict) -> Any:
        if self._num_tokens is None:
            with at_layer(ids):
                return self._fn(layer, args, kwargs)
        _mark_token_dim((args, kwargs), self._num_tokens)
        try:
            with at_layer(ids):
                return self._fn(layer, args, kwargs)
        except Exception as e:  # while building: a layer dynamo cannot trace, said in one line
            raise CompileRefused(_refusal(layer, ids, e, self.compiler)) from e


def compile_layers(model: torch.nn.Module, compiler: str) -> CompiledLayers:
    """``model.forward_layers`` compiled layer by layer with ``compiler`` ("inductor" or "traced"); see
    :class:`CompiledLayers`."""
    return CompiledLayers(model, compiler)


def _custom_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The custom ops ``gm`` calls, one name per call (``"bcg.rms_norm"``): aten and Python functions left out."""
    names = []
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", node.target) if node.op == "call_function" else None
        if isinstance(packet, torch._ops.OpOverloadPacket) and not str(packet).startswith("aten."):
            names.append(str(packet))
    return names


def _mark_token_dim(value: Any, num_tokens: int) -> None:
    """Marks the token dimension of every activation in ``value`` dynamic: dim 0 of token-major tensors (bcg's
    models), dim 1 of ``(1, tokens, ...)`` ones (transformers' layout). 1-D float tensors (frequencies, sinks) are
    weights, whatever their size."""
    for t in tensor_leaves(value):
        if t.ndim == 1 and t.is_floating_point():
            continue
        if t.shape[0] == num_tokens:
            torch._dynamo.mark_dynamic(t, 0)
        elif t.ndim >= 2 and t.shape[0] == 1 and t.shape[1] == num_tokens:
            torch._dynamo.mark_dynamic(t, 1)


def _refusal(layer: torch.nn.Module, ids: LayerIds, e: BaseException, compiler: str) -> str:
    """One line: which layer, why (dynamo's explanation and the model's line it stopped at), and what to do."""
    text = str(e)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
    calls_island = any(f[0].endswith("bcg/islands.py") for f in frames)
    own = [f for f in frames if "/torch/" not in f[0] and not f[0].endswith(_PLUMBING)]
    at = ""
    if own:
        path, line, fn = own[-1]
        at = f" at {'/'.join(path.split('/')[-2:])}:{line} ({fn})"
    explanation = re.search(r"Explanation: (.+)", text)
    reason = explanation.group(1).strip() if explanation else first_line(e)
    if calls_island:
        reason = ("it calls an @eager_on_graph island that is not one of bcg's custom ops (dynamo cannot trace an "
                  "island's wrapper)")
    elif "ConstraintViolation" in type(e).__name__ or "Constraints violated" in text:
        at = ""  # dynamo reports where the guard was checked, not the line that made it
        reason = ("its code makes the token count a constant (dynamo specialised the dynamic dimension), so one "
                  "trace cannot serve every bucket")
    original = getattr(layer, "original", None)
    name = f"{type(original).__name__} (fused by bcg)" if original is not None else type(layer).__name__
    if ids.attention is not None:
        name += f", layer {ids.attention}"
    return (f"torch.compile cannot trace {name}{at}: {reason}. Fix: run without compile= (the engine now serves the "
            f"uncompiled layer stack, graphs included); BCG_COMPILE_LOG=1 shows dynamo's log of the "
            f"attempt").replace("\n", " ")


# Frames of bcg's own region plumbing, never where a model stopped dynamo.
_PLUMBING = ("bcg/runtime/compile.py", "bcg/models/regions.py", "bcg/models/hf/layer_regions.py", "bcg/islands.py")
_NUM_REGIONS = itertools.count()


def _private_region() -> Callable[[torch.nn.Module, tuple, dict], Any]:
    """The region function, with a code object and a name of its own.

    Dynamo keeps compiled code and guards per code object, and what it learnt about sizes (automatic dynamic shapes)
    per function name and line: one copy per engine, named apart, keeps engines in one process from evaluating each
    other's guards at every call, from sharing one recompile limit and from marking each other's weights dynamic.
    """

    def region(layer: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        return layer(*args, **kwargs, **{REGION_FLAG: True})

    name = f"bcg_region_{next(_NUM_REGIONS)}"
    code = region.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, region.__globals__, name, region.__defaults__, region.__closure__)
