"""The step a runner captures for each bucket: embedding, layer stack, and the LM head on each request's last row.

A forward spends its host time before the first kernel with the GPU idle, and after the last segment launching the
LM head. So the captured step starts at the token ids and ends at the logits: ``embed(input_ids)``, the layer stack
(``model.forward_layers``, or its compiled form), the hidden rows copied into ``static_output`` (what the
verification tools compare), then the final norm and LM head on the ``logit_rows`` (the last token of each request
that ends in this batch) into ``static_logits``, which the head writes itself where the model can (``out=``): one
logits buffer per engine, shared by every bucket, rather than a ``(rows, vocab)`` temporary held by each graph.
Eager batches run the very same function on tensors of their own size, so a graph and its eager fallback compute
the same thing.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["ModelStep", "StepFn"]

StepFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]


class ModelStep:
    """``model``'s forward from token ids to logits, written into the given buffers; the one owner of the layer
    stack every path runs (graphs, eager batches, verification).

    Args:
        model: the model (``embed``, ``forward_layers``, ``compute_logits``).
        layers: the layer stack to run: ``model.forward_layers`` or its compiled form.

    Example::

        step = ModelStep(model, model.forward_layers)
        with forward_context(ctx):
            step(input_ids, positions, logit_rows, out, logits)   # out: (T, hidden), logits: (R, vocab) fp32
    """

    def __init__(self, model: torch.nn.Module, layers: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.model = model
        self.layers = layers
        # A head that writes the logits buffer itself needs no copy after it, and in fp32 holds no (rows, vocab)
        # temporary: with a large vocabulary that temporary, kept by every bucket's graph, would be most of the
        # graphs' memory.
        self.head_writes_out = "out" in inspect.signature(model.compute_logits).parameters

    @property
    def layers(self) -> Callable[..., Tensor]:
        """The layer stack the step runs (settable: tools wrap it)."""
        return self._layers

    @layers.setter
    def layers(self, layers: Callable[..., Tensor]) -> None:
        self._layers = layers
        # A layer stack that ends in ``out`` (the uncompiled one of bcg's models) needs no copy into it after.
        self.layers_write_out = not self.is_compiled and "out" in inspect.signature(layers).parameters

    @property
    def is_compiled(self) -> bool:
        # ==, not is: each attribute access makes a new bound method, equal to the others.
        return self._layers != getattr(self.model, "forward_layers", None)

    def __call__(self, input_ids: Tensor, positions: Tensor, logit_rows: Tensor, out: Tensor, logits: Tensor) -> None:
        if self.layers_write_out:
            self.layers(self.model.embed(input_ids), positions, out=out)
        else:
            out.copy_(self.layers(self.model.embed(input_ids), positions))
        if self.head_writes_out:
            self.model.compute_logits(out[logit_rows], out=logits)
        else:
            logits.copy_(self.model.compute_logits(out[logit_rows]))

    def function(self) -> StepFn:
        """The step as a plain function with a code object of its own (what ``torch.compile`` takes: dynamo keeps
        compiled code and guards per code object, so one copy per engine keeps engines in one process from
        evaluating each other's guards and sharing one recompile limit). It runs the uncompiled layer stack."""
        model = self.model

        def step(input_ids: Tensor, positions: Tensor, logit_rows: Tensor, out: Tensor, logits: Tensor) -> None:
            out.copy_(model.forward_layers(model.embed(input_ids), positions))
            logits.copy_(model.compute_logits(out[logit_rows]))

        return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                                  step.__closure__)
