"""Weights joined along their output rows into one tensor, with the original parameters viewing it (no second copy).

A fused q/k/v or gate/up projection needs one ``(sum of rows, in)`` matrix. :class:`JoinedWeight` concatenates the
parts once and points each original ``Parameter``'s ``.data`` at its slice of the result, so the model holds the
weights once and every parameter object stays the one the model had (its name in the state dict, its identity). A
part may be stored with its rows permuted (RoPE's layout for the fused kernel); its parameter then views the
permuted rows until :meth:`JoinedWeight.split` puts every parameter back in its own storage, in its own order.

Example:
    >>> import torch
    >>> a, b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.zeros(1, 3))
    >>> joined = JoinedWeight([a, b])
    >>> joined.tensor.shape, a.data_ptr() == joined.tensor.data_ptr()
    (torch.Size([3, 3]), True)
    >>> joined.split(); a.data_ptr() == joined.tensor.data_ptr()
    False
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["JoinedWeight", "head_rows"]


def head_rows(perm: Tensor, num_heads: int) -> Tensor:
    """Row indices that apply the per-head permutation ``perm`` (of ``head_dim`` entries) to every head."""
    dim = perm.numel()
    return (torch.arange(num_heads, device=perm.device)[:, None] * dim + perm[None, :]).flatten()


class JoinedWeight:
    """The parts' rows concatenated (each optionally permuted by ``rows[i]``), the parts viewing their slices.

    Args:
        parts: parameters (or tensors) with the same trailing shape, joined along dim 0.
        rows: per part, None or the row order it is stored in (``joined part = part[rows]``).
    """

    def __init__(self, parts: Sequence[Tensor], rows: Sequence[Tensor | None] | None = None) -> None:
        self.parts = list(parts)
        self.rows = list(rows) if rows is not None else [None] * len(self.parts)
        with torch.no_grad():
            self.tensor = torch.cat([p.data if r is None else p.data[r] for p, r in zip(self.parts, self.rows)])
            start = 0
            for p in self.parts:
                n = p.shape[0]
                p.data = self.tensor[start : start + n]
                start += n
        self.is_split = False

    def split(self) -> None:
        """Gives every part its own storage again, rows in their original order (idempotent)."""
        if self.is_split:
            return
        with torch.no_grad():
            for p, r in zip(self.parts, self.rows):
                p.data = p.data.clone() if r is None else p.data[torch.argsort(r)].clone()
        self.is_split = True
