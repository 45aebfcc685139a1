"""The forward context: what the eager islands of a forward read, installed by whoever runs the layer stack.

The captured part of a forward sees only fixed-shape tensors; everything that changes from batch to batch (the
real token count, request boundaries, KV slots) lives in a context that the runner installs with
:func:`forward_context` around each replay, and that the islands fetch with :func:`get_forward_context`. A
``ContextVar`` (not a global) keeps the contexts of different threads apart; the static buffers a graph replays are
shared, though, so the runner serialises its forwards (``Runner.lock``).

Which attention runs is whatever the installed context says (its backend, :mod:`bcg.ops.attention`): the live
:class:`~bcg.ops.attention.base.BatchContext` of one packed batch, whose island attends eagerly between graph
segments over the live metadata, or the :class:`~bcg.ops.attention.static.StaticContext` of a whole-graph capture,
which attends inside the graph over fixed-size fields. Islands never ask which one they hold.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch  # noqa: F401 - the doctest below uses it
from torch import Tensor

from bcg.capture_rules import UncapturableOpError

if TYPE_CHECKING:
    from bcg.ops.kv_cache import KVPool

__all__ = ["AttentionFeatures", "ForwardContext", "LayerIds", "current_forward_context", "forward_context",
           "forward_state", "get_forward_context"]


@dataclass(frozen=True, eq=False)
class AttentionFeatures:
    """What one layer's attention adds to plain causal attention (each ``None`` when absent).

    Attributes:
        scale: softmax scale; None means ``head_dim ** -0.5``.
        window: sliding window ``W`` (a query sees itself and the ``W - 1`` keys before it).
        softcap: logits become ``softcap * tanh(logits / softcap)`` before the softmax.
        sinks: ``(num_heads,)`` sink logit per head.

    Example:
        >>> AttentionFeatures(window=4, sinks=torch.zeros(2)).describe()
        'sliding window 4, attention sinks'
    """

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = None

    def describe(self) -> str:
        parts = [f"sliding window {self.window}" if self.window is not None else "",
                 "attention sinks" if self.sinks is not None else "",
                 f"logit soft-cap {self.softcap}" if self.softcap is not None else "",
                 f"scale {self.scale:.4g}" if self.scale is not None else ""]
        return ", ".join(p for p in parts if p) or "plain causal attention"


@dataclass(frozen=True)
class LayerIds:
    """What a layer's islands index the pool by: its attention layer (KV cache) and its DSA index group."""

    attention: int | None = None
    index_group: int | None = None


class ForwardContext(ABC):
    """What every forward context offers the layers and the islands: the one owner of a forward's ambient state.

    Attributes:
        num_padded_tokens: rows the layer stack runs on (the bucket).
        kv_pool: the pool the islands read and write.
        attends_in_graph: whether :meth:`attend` is captured inside the graph (else it runs in an island).
        write_slots: int64 ``(num_padded_tokens,)``: each row's KV-pool slot (padded rows: the scratch slot).
        layer: the layer whose compiled region is running (:mod:`bcg.ops.region_islands` reads it), or None.
        region_runner: what runs each layer of a regionally compiled stack (:mod:`bcg.models.regions`), or None.
    """

    num_padded_tokens: int
    kv_pool: KVPool
    write_slots: Tensor
    attends_in_graph: bool = False
    layer: LayerIds | None = None
    region_runner: Callable[..., Any] | None = None

    @abstractmethod
    def store_kv(self, layer_id: int, k: Tensor, v: Tensor) -> None:
        """Writes every row's K/V of layer ``layer_id`` into the pool (fixed shapes: captured in the segment)."""

    def kv_destination(self, layer_id: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(k_cache, v_cache, slots)`` of layer ``layer_id`` for a kernel that writes the K/V itself, or None when
        this context has no such place (a pool whose layer holds other buffers)."""
        k, v = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        return None if k is None or v is None else (k, v, self.write_slots)

    @abstractmethod
    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        """This batch's causal attention of layer ``layer_id`` into ``out`` (its K/V already stored)."""

    def attend_with(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    features: AttentionFeatures) -> None:
        """:meth:`attend` with a sliding window, sinks, a logit soft-cap or a softmax scale (``features``).

        A context without such a path (a whole-graph capture's) raises :class:`~bcg.capture_rules.UncapturableOpError`
        naming the features, so the backend is refused by name rather than computing plain attention.
        """
        raise UncapturableOpError(
            f"attention layer {layer_id} uses {features.describe()}, which {type(self).__name__} does not implement "
            "(a whole-layer-stack graph captures plain causal attention only)")

    @abstractmethod
    def live(self, island: str, why: str) -> ForwardContext:
        """The live batch metadata (a :class:`~bcg.ops.attention.BatchContext`), for islands that read it on the
        host or have data-dependent shapes.

        A context that has none (a whole-graph capture) raises :class:`~bcg.capture_rules.UncapturableOpError` naming
        ``island`` and ``why``, so the backend is refused by name instead of failing on an attribute.
        """


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("bcg_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Installs ``ctx`` as the current forward context for the duration of the ``with`` block.

    Nests: the previous context (if any) is restored on exit.

    Example::

        with forward_context(batch.to_context(num_padded_tokens=16)):
            hidden = model.forward_layers(hidden, positions)
    """
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_forward_context() -> ForwardContext | None:
    """The current forward context, or None outside any (for code that also runs without one)."""
    return _CURRENT.get()


@contextmanager
def forward_state(**values: Any) -> Iterator[ForwardContext]:
    """Sets attributes of the current forward context (``layer``, ``region_runner``) for the ``with`` block and
    restores them after: per-forward state has one owner, the context, not a variable of its own.

    Example::

        with forward_state(layer=LayerIds(attention=3)):
            region(layer, hidden)
    """
    ctx = get_forward_context()
    before = {name: getattr(ctx, name) for name in values}
    for name, value in values.items():
        setattr(ctx, name, value)
    try:
        yield ctx
    finally:
        for name, value in before.items():
            setattr(ctx, name, value)


def get_forward_context() -> ForwardContext:
    """The current forward context.

    Raises:
        RuntimeError: no context is installed (an island ran outside ``forward_context``).
    """
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "no ForwardContext is set: run the model's forward_layers inside "
            "`with bcg.ops.context.forward_context(ctx):` (the runner does this for each batch)"
        )
    return ctx
