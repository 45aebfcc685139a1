"""The torch.compile backend of "tc_piecewise": split the traced layer stack at the islands, compile the pieces,
and give every piece one graph per token bucket.

:class:`PiecewiseCompiler` is a compile backend (``(gm, example_inputs) -> callable``). It cuts the dynamo graph
at every registered split op (:mod:`bcg.ops.custom_ops`) with ``torch.fx.passes.split_module``, compiles each
other piece (Inductor, or nothing for ``tc_compiler="traced"``) and wraps it in a :class:`GraphedPiece`. The split
graph it returns runs pieces and islands in order; what each piece does depends on :class:`PieceRuntime`:
run (``"eager"``), capture its own graph for the current bucket (``"capture"``), or replay it (``"replay"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from bcg import env
from bcg.ops.custom_ops import UNSPLITTABLE, is_split_node, island_fn, unsplittable_islands
from bcg.runtime.backends.base import BackendRefused
from bcg.runtime.backends.capture import GraphPool, capturing, new_graph

__all__ = ["GraphedPiece", "PieceRuntime", "PiecewiseCompiler"]



@dataclass
class PieceRuntime:
    """State shared by the backend and its pieces: what a piece call does now, and for which bucket.

    Attributes:
        mode: "eager" (run), "capture" (capture a graph for ``bucket``) or "replay" (replay ``bucket``'s graph).
        bucket: the token bucket of the current call.
        pool: the runner's graph pool (its handle is read at each capture); is_emulated: capture EmulatedGraphs.
        captured: pieces captured since the backend last reset it (one capture per bucket).
    """

    mode: str = "eager"
    bucket: int = 0
    pool: GraphPool = field(default_factory=lambda: GraphPool(None))
    is_emulated: bool = True
    captured: int = 0


class GraphedPiece:
    """One compiled piece with a graph per bucket; its inputs are static (the runner's buffers, parameters and
    the recorded outputs of earlier pieces), so replay copies nothing and returns the outputs recorded at capture.

    Example::

        piece = GraphedPiece("submod_0", compiled_fn, runtime)
        runtime.mode, runtime.bucket = "capture", 16
        outs = piece(*static_inputs)          # captures bucket 16
        runtime.mode = "replay"
        outs is piece(*static_inputs)         # True: the same tensors, refreshed by the replayed graph
    """

    def __init__(self, name: str, fn: Any, runtime: PieceRuntime) -> None:
        self.name, self.fn, self.runtime = name, fn, runtime
        self.graphs: dict[int, tuple[Any, Any, list[int]]] = {}

    def __call__(self, *args: Any) -> Any:
        rt = self.runtime
        if rt.mode == "replay":
            entry = self.graphs.get(rt.bucket)
            if entry is None:
                raise RuntimeError(f"piece {self.name} has no graph for bucket {rt.bucket}: torch.compile "
                                   "probably recompiled the layer stack after capture (a guard failed)")
            graph, outputs, pointers = entry
            if env.DEBUG and pointers != _pointers(args):
                raise RuntimeError(f"piece {self.name}, bucket {rt.bucket}: input addresses differ from capture; "
                                   "a piece input is not static")
            graph.replay()
            return outputs
        if rt.mode == "capture":
            graph = new_graph(rt.is_emulated)
            with capturing(graph, rt.pool.handle):
                outputs = self.fn(*args)
            self.graphs[rt.bucket] = (graph, outputs, _pointers(args))
            rt.captured += 1
            return outputs
        return self.fn(*args)


def _pointers(args: tuple) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


@dataclass
class PiecewiseCompiler:
    """A ``torch.compile`` backend that splits at the islands and graphs each piece (see the module docstring).

    Args:
        runtime: the shared :class:`PieceRuntime`.
        compiler: "inductor" (``compile_fx`` per piece, dynamic token dimension) or "traced" (the FX piece as is).

    Example::

        compiler = PiecewiseCompiler(PieceRuntime(), "traced")
        step = torch.compile(step, fullgraph=True, backend=compiler)
    """

    runtime: PieceRuntime
    compiler: str = "inductor"
    num_compiles: int = 0
    num_pieces: int = 0
    num_islands: int = 0
    pieces: list[GraphedPiece] = field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if self.runtime.mode == "replay":
            raise RuntimeError("torch.compile recompiled the layer stack during replay (a guard failed); replay "
                               "needs the graph traced at build. Replay under torch.inference_mode(), as captured")
        self.num_compiles += 1
        refused = unsplittable_islands(gm)
        if refused:
            message = (f"a piecewise graph cannot hold the island {refused[0]}: it is not a split point, so a "
                       f"piece would capture it ({UNSPLITTABLE[refused[0]]}).")
            return _refuser(message)
        split = _split(gm)
        compute = [name for name, sub in split.named_children() if not _is_island(sub)]
        if self.compiler == "inductor":
            compiled = _inductor_pieces(split, gm, set(compute))
        else:
            compiled = {name: getattr(split, name).forward for name in compute}
        islands = 0
        for name, sub in list(split.named_children()):
            if name in compiled:
                piece = GraphedPiece(name, compiled[name], self.runtime)
                self.pieces.append(piece)
                _replace(split, name, piece)
            else:
                _replace(split, name, _direct_island(sub))
                islands += 1
        self.num_pieces, self.num_islands = len(compiled), islands
        return split.forward


def _refuser(message: str) -> Any:
    def refuse(*args: Any) -> None:
        raise BackendRefused(message)

    return refuse


def _split(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Cuts ``gm`` before and after every split node; each split node becomes a piece of its own."""
    partition, index = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node):
            partition[node] = index + 1
            index += 2
        else:
            partition[node] = index
    # keep_original_order: an island that only mutates its output must still run before that output's readers.
    return split_module(gm, None, lambda node: partition[node], keep_original_order=True)


def _is_island(sub: torch.nn.Module) -> bool:
    return isinstance(sub, torch.fx.GraphModule) and any(is_split_node(n) for n in sub.graph.nodes)


def _direct_island(sub: torch.fx.GraphModule) -> Any:
    """The island piece calling the island's Python function instead of the custom op (no dispatcher trip)."""
    for node in sub.graph.nodes:
        if is_split_node(node):
            node.target = island_fn(node)
    sub.recompile()
    return sub.forward


def _replace(split: torch.fx.GraphModule, name: str, fn: Any) -> None:
    # A plain attribute instead of a submodule: the split graph then calls it without nn.Module.__call__.
    delattr(split, name)
    object.__setattr__(split, name, fn)


def _inductor_pieces(split: torch.fx.GraphModule, gm: torch.fx.GraphModule, names: set[str]) -> dict[str, Any]:
    """Compiles each compute piece with Inductor, with fake inputs carrying the traced symbolic sizes.

    The split graph is run under dynamo's fake mode (placeholders' example values), so every piece is compiled
    against fake tensors whose token dimension is the same symbol: one compiled piece serves every bucket.
    """
    from torch._inductor.compile_fx import compile_fx

    fake_args = [node.meta.get("example_value", node.meta.get("val"))
                 for node in gm.graph.nodes if node.op == "placeholder"]
    fake_mode = next(a.fake_mode for a in fake_args if isinstance(a, torch._subclasses.FakeTensor))
    piece_args: dict[str, list[Any]] = {}

    class _Propagate(torch.fx.Interpreter):
        def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
            if target in names:
                piece_args[target] = list(args)
            return super().call_module(target, args, kwargs)

    with fake_mode:
        _Propagate(split).run(*fake_args)
    compiled: dict[str, Any] = {}
    for name, args in piece_args.items():
        # A tracing context of that fake mode, as dynamo gives its own backend, so the symbols are known.
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            compiled[name] = compile_fx(getattr(split, name), args)
    return compiled
