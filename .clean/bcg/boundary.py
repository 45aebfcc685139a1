"""Boundary buffers: what an eager function returns, kept at fixed addresses across replays.

At capture the value an ``@eager_on_graph`` function returns is flattened into a *spec* (its structure, with
non-tensor leaves baked in) and a list of tensor leaves. The leaves become persistent boundary buffers that later
segments were captured against. At replay the fresh result is flattened the same way, checked against the spec,
and copied into those buffers in place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["BoundaryMismatchError", "Boundary"]


class BoundaryMismatchError(RuntimeError):
    """A replayed eager function returned something that does not fit the buffers captured for it."""


# A spec is a hashable-ish nested tuple: ("T", shape, dtype, device) for a device tensor leaf,
# ("V", value) for a baked value, (kind, type, keys, children) for containers.
Spec = tuple


def _tensor_spec(t: torch.Tensor) -> Spec:
    return ("T", tuple(t.shape), t.dtype, t.device)


def flatten(value: Any, device_type: str, leaves: list[torch.Tensor], bake: bool = True) -> Spec:
    """Flattens ``value`` into a spec, appending tensors on ``device_type`` to ``leaves``.

    Tensors on another device (e.g. CPU tensors next to a CUDA graph) cannot be refreshed inside the graph,
    which read them at capture time, so they are baked like Python values: copied when ``bake`` (the captured
    spec must not change with its owner's tensor), referenced as they are otherwise (a replay's spec is only
    compared, then dropped).
    """
    if isinstance(value, torch.Tensor):
        if value.device.type == device_type:
            leaves.append(value)
            return _tensor_spec(value)
        return ("V", value.detach().clone() if bake else value)
    if isinstance(value, (tuple, list)):
        kids = tuple(flatten(v, device_type, leaves, bake) for v in value)
        return ("S", type(value), len(value), kids)
    if isinstance(value, dict):
        keys = tuple(value.keys())
        kids = tuple(flatten(value[k], device_type, leaves, bake) for k in keys)
        return ("D", type(value), keys, kids)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        keys = tuple(f.name for f in dataclasses.fields(value))
        kids = tuple(flatten(getattr(value, k), device_type, leaves, bake) for k in keys)
        return ("C", type(value), keys, kids)
    return ("V", value)


def _same_value(a: Any, b: Any) -> bool:
    """Equality of baked values, with NaN equal to NaN: a function that returns a NaN statistic returns the same
    value on every replay, and NaN != NaN would fail each one with a spurious mismatch."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype):
            return False
        b = b.to(a.device)
        return bool(torch.equal(a, b)) or bool(((a == b) | (a.isnan() & b.isnan())).all())
    try:
        if type(a) is not type(b):
            return False
        return bool(a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # values whose == is not a bool (e.g. numpy arrays) compare by identity
        return a is b


def same_spec(a: Spec, b: Spec) -> bool:
    """Structural equality of two specs, comparing baked values by value."""
    if a[0] != b[0]:
        return False
    if a[0] == "V":
        return _same_value(a[1], b[1])
    if a[0] == "T":
        return a == b
    return a[1] is b[1] and a[2] == b[2] and all(same_spec(x, y) for x, y in zip(a[3], b[3]))


def describe(spec: Spec) -> str:
    """A readable signature of a spec, for error messages."""
    kind = spec[0]
    if kind == "T":
        _, shape, dtype, device = spec
        return f"Tensor(shape={list(shape)}, dtype={dtype}, device={device})"
    if kind == "V":
        v = spec[1]
        if isinstance(v, torch.Tensor):  # baked (off-device) tensor: signature, values only if small
            sig = f"baked Tensor(shape={list(v.shape)}, dtype={v.dtype}, device={v.device})"
            return f"{sig} = {v.tolist()!r}" if v.device.type == "cpu" and v.numel() <= 16 else sig
        return f"{type(v).__name__}({v!r})"
    if kind == "S":
        inner = ", ".join(describe(c) for c in spec[3])
    else:
        inner = ", ".join(f"{k!s}={describe(c)}" for k, c in zip(spec[2], spec[3]))
    return f"{spec[1].__name__}({inner})"


class Boundary:
    """The boundary buffers of one eager step: the captured result and how to refresh it at replay."""

    __slots__ = ("name", "device_type", "value", "spec", "buffers", "is_single_tensor")

    def __init__(self, name: str, value: Any, device_type: str) -> None:
        self.name = name
        self.device_type = device_type
        self.value = value  # strong reference: the buffers must outlive every segment that reads them
        self.buffers: list[torch.Tensor] = []
        self.spec = flatten(value, device_type, self.buffers)
        self.is_single_tensor = isinstance(value, torch.Tensor) and value.device.type == device_type

    def refresh(self, result: Any) -> None:
        """Copies a replay-time ``result`` into the captured buffers, or raises if it does not fit."""
        if self.is_single_tensor:
            # Fast path for the common case: one tensor. copy_ would broadcast silently, so check the shape.
            buf = self.value
            if (
                isinstance(result, torch.Tensor)
                and result.shape == buf.shape
                and result.dtype == buf.dtype
                and result.device == buf.device
            ):
                if result.data_ptr() != buf.data_ptr() or result.stride() != buf.stride():
                    buf.copy_(result)
                return
            self._mismatch(result)
        if self.value is None:
            if result is not None:
                self._mismatch(result)
            return
        leaves: list[torch.Tensor] = []
        spec = flatten(result, self.device_type, leaves, bake=False)
        if not same_spec(self.spec, spec):
            self._mismatch(result, spec)
        for buf, new in zip(self.buffers, leaves):
            if new.data_ptr() != buf.data_ptr() or new.stride() != buf.stride():
                buf.copy_(new)

    def _mismatch(self, result: Any, spec: Spec | None = None) -> None:
        if spec is None:
            spec = flatten(result, self.device_type, [], bake=False)
        raise BoundaryMismatchError(
            f"eager function {self.name!r} returned a value at replay that does not match the one captured.\n"
            f"  captured: {describe(self.spec)}\n"
            f"  replay:   {describe(spec)}\n"
            "Later graph segments were captured against the captured buffers (and any Python values in it are "
            "baked into them), so the result must keep its structure, shapes, dtypes, devices and non-tensor "
            "values. Pad to fixed shapes, or write into a preallocated argument and return None."
        )
