"""Grouped-query SDPA on whatever this torch version offers: ``enable_gqa`` where it exists, expanded K/V else."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["gqa_sdpa"]

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def gqa_sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
    """``F.scaled_dot_product_attention`` over ``(B, H, L, D)`` queries and ``(B, H_kv, S, D)`` keys/values.

    Fewer K/V heads than query heads share each K/V head among ``H // H_kv`` consecutive query heads. Without
    ``enable_gqa`` the K/V heads are expanded (a view plus one reshape: fixed shapes, capturable).

    Example::

        >>> import torch
        >>> gqa_sdpa(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), is_causal=True).shape
        torch.Size([1, 4, 3, 8])
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        if _HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k = k[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
            v = v[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
