"""The tensors inside a nested value, and the storage a tensor views: what the capture-side checks walk.

Example::

    >>> import torch
    >>> a, b = torch.zeros(2), torch.ones(3)
    >>> [t.shape[0] for t in tensor_leaves({"x": (a, [b]), "n": 3})]
    [2, 3]
    >>> storage_key(a[1:]) == storage_key(a)
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["storage_key", "tensor_leaves"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (tensors, tuples, lists, dicts and dataclasses of them), in traversal order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensor_leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensor_leaves(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensor_leaves(getattr(value, f.name))]
    return []


def storage_key(t: torch.Tensor) -> int:
    """The address of the storage ``t`` views: equal for every view of one allocation."""
    return t.untyped_storage().data_ptr()
