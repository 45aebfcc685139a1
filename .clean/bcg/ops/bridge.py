"""Bridge buffers: one set of max-size tensors that carries island inputs and outputs for every layer and bucket.

A breakable graph keeps every tensor that crosses a break alive for its whole life (that is what makes it safe).
If each layer's q/k/v/out were fresh pool tensors, every bucket would pin its own copies: the sum over buckets and
layers, gigabytes for a 42-bucket ladder. Instead, while the runner captures, the model copies the island inputs
into views of shared buffers and lets the island write into a shared output view. Layer ``l``'s views are consumed
by its island before layer ``l + 1`` overwrites them, and one runner replays one bucket at a time, so one set of
buffers sized for the largest bucket serves all of them. Outside a capture nothing is bridged.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["BridgeBuffers", "bridge_buffers", "carry", "empty", "output_like"]


class BridgeBuffers:
    """Lazily allocated ``(max_tokens, *tail)`` buffers, one per (name, tail shape, dtype).

    Example::

        bridge = BridgeBuffers(max_tokens=2048)
        with bridge_buffers(bridge):
            q, k, v = carry("attn", q, k, v)      # inside a capture: views of the shared buffers
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._buffers: dict[tuple, Tensor] = {}

    def view(self, key: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A ``like``-shaped view of the buffer ``key`` (first ``like.shape[0]`` rows), of ``like``'s dtype or
        ``dtype``."""
        return self.take(key, tuple(like.shape), dtype or like.dtype, like.device)

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A ``shape``-d view of the buffer ``key`` (its first ``shape[0]`` rows), allocated on first use."""
        full_key = (key, tuple(shape[1:]), dtype, device)
        buf = self._buffers.get(full_key)
        if buf is None:
            if shape[0] > self.max_tokens:
                raise ValueError(f"bridge buffer {key!r} holds {self.max_tokens} rows, got {shape[0]}")
            buf = torch.empty((self.max_tokens, *shape[1:]), dtype=dtype, device=device)
            self._buffers[full_key] = buf
        return buf[: shape[0]]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_BRIDGE: contextvars.ContextVar[BridgeBuffers | None] = contextvars.ContextVar("bcg_bridge", default=None)


@contextmanager
def bridge_buffers(bridge: BridgeBuffers) -> Iterator[BridgeBuffers]:
    """Routes :func:`carry` and :func:`output_like` through ``bridge`` inside the block (the runner's capture)."""
    token = _BRIDGE.set(bridge)
    try:
        yield bridge
    finally:
        _BRIDGE.reset(token)


def carry(name: str, *tensors: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """The tensors an island will read: copies into shared views while bridging, else the tensors themselves.

    With ``dtype`` the result is cast to it; while bridging the cast happens in the copy (no extra kernel).
    """
    bridge = None if torch.compiler.is_compiling() else _BRIDGE.get()  # dynamo cannot trace ContextVar.get
    if bridge is None:
        return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)
    views = tuple(bridge.view(f"{name}.{i}", t, dtype) for i, t in enumerate(tensors))
    for view, t in zip(views, tensors):
        view.copy_(t)
    return views


def output_like(name: str, like: Tensor) -> Tensor:
    """An uninitialised output buffer shaped like ``like`` for an island to write into."""
    bridge = None if torch.compiler.is_compiling() else _BRIDGE.get()
    return torch.empty_like(like) if bridge is None else bridge.view(f"{name}.out", like)


def empty(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised ``shape``-d tensor an island will read, for a kernel to write its inputs straight into: a
    shared view while bridging (no copy needed), else a fresh tensor."""
    bridge = None if torch.compiler.is_compiling() else _BRIDGE.get()
    return torch.empty(shape, dtype=dtype, device=device) if bridge is None else bridge.take(name, shape, dtype, device)
