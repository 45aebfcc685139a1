"""DeepSeek sparse attention (deepseek_v32, glm_moe_dsa) as module islands: the model's own module, run per request.

In these models the indexer is a submodule of the attention module, called from its forward *before* the attention
function, with the keys it gets from ``cache.update_indexer``; its top-k therefore depends on every key the request
can see, cached prefix included, and only its result reaches the attention function (``indices=``). So the
attention function alone cannot honour DSA on packed or chunked batches: the indexer would score other requests'
keys and miss the prefix. Instead the whole attention module becomes an ``@eager_on_graph`` island that runs the
module's own forward once per request, with

* that request's rows of hidden states, rotary cos/sin and position ids;
* a bottom-right causal boolean mask ``(1, 1, Lq, Lk)`` over prefix + new keys;
* a :class:`RequestCache` shaped like transformers' Cache for the two calls DSA modules make: ``update`` writes the
  request's new entries into bcg's pool at its slots and returns prefix + new, ``update_indexer`` does the same for
  the indexer keys. What ``update`` receives is whatever this transformers version caches (expanded K/V in 5.17,
  the compressed MLA latents in 5.24), so the pool's per-layer shapes are probed, never assumed;
* the ``"bcg"`` attention function in module-island mode: masked attention honouring ``indices``.

Cross-layer top-k sharing (glm_moe_dsa's ``"shared"`` indexer layers) works because the island returns the top-k
rows padded to ``index_topk`` (a fixed boundary shape) and the next island slices them again per request.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from bcg import eager_on_graph
from bcg.models.hf.attention import module_island_mode
from bcg.ops.context import get_forward_context

__all__ = ["RequestCache", "install_dsa_islands", "is_dsa_attention"]

_WHY = ("it runs the model's DSA attention module once per request over that request's cached prefix (a host loop "
        "over requests with data-dependent shapes)")


class RequestCache:
    """One request's view of the pool, shaped like transformers' Cache for ``update`` and ``update_indexer``.

    With ``buffers=None`` (the adapter's probe) it records each entry's per-token shape in ``shapes`` and passes the
    tensors through.
    """

    def __init__(self, buffers: dict[str, Tensor] | None, write: Tensor | None = None, read: Tensor | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.buffers, self.write, self.read, self.shapes = buffers, write, read, shapes

    def _store(self, name: str, t: Tensor, seq_dim: int) -> Tensor:
        rows = t[0].movedim(seq_dim - 1, 0)  # (S, *per_token)
        if self.buffers is None:
            self.shapes[name] = tuple(rows.shape[1:])
            return t
        buf = self.buffers[name]
        buf.index_copy_(0, self.write, rows.to(buf.dtype))
        return buf[self.read].movedim(0, seq_dim - 1)[None].to(t.dtype)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self._store("k", key, 2), self._store("v", value, 2)

    def update_indexer(self, key: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        return self._store("index", key, 1)


def is_dsa_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a DSA attention module (it owns an indexer, or reuses a previous layer's top-k)."""
    return isinstance(getattr(module, "layer_idx", None), int) and (hasattr(module, "indexer")
                                                                     or hasattr(module, "skip_topk"))


def install_dsa_islands(body: nn.Module, island_shapes: dict[int, dict[str, tuple[int, ...]]],
                        probing: Callable[[], bool]) -> list[str]:
    """Wraps each DSA attention module's forward as a module island; returns the wrapped module paths.

    ``island_shapes`` receives, per layer, the per-token shapes the module caches, on a call made while
    ``probing()`` is true (the adapter's probe forward).
    """
    wrapped = []
    for path, module in body.named_modules():
        if is_dsa_attention(module):
            module.forward = _make_island(module, path, island_shapes, probing)
            wrapped.append(path)
    return wrapped


def _make_island(module: nn.Module, path: str, island_shapes: dict, probing: Callable[[], bool]) -> Callable:
    original = module.forward
    cache_kw = "cache" if "cache" in inspect.signature(original).parameters else "past_key_values"  # 5.24 / 5.17
    layer, topk = module.layer_idx, module.config.index_topk

    def run(hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, position_ids: Tensor | None,
            prev_topk: Tensor | None, cache: RequestCache, kwargs: dict) -> tuple:
        extra = {} if prev_topk is None else {"prev_topk_indices": prev_topk}
        out = original(hidden, position_embeddings=(cos, sin), attention_mask=mask, position_ids=position_ids,
                       **{cache_kw: cache}, **extra, **kwargs)
        return _pad_topk(out, topk)

    def dsa_attention(hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                      attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                      prev_topk_indices: Tensor | None = None, **kwargs: Any) -> tuple:
        for k in ("cache", "past_key_values", "past_key_value", "use_cache"):
            kwargs.pop(k, None)
        cos, sin = position_embeddings
        rows = hidden_states.shape[1]
        if probing():  # what this transformers version caches, per token
            shapes: dict[str, tuple[int, ...]] = {}
            mask = torch.ones(rows, rows, dtype=torch.bool, device=hidden_states.device).tril()[None, None]
            out = run(hidden_states, cos, sin, mask, position_ids, prev_topk_indices,
                      RequestCache(None, shapes=shapes), kwargs)
            island_shapes[layer] = shapes
            return out
        ctx = get_forward_context().live(f"the DSA attention module {path}", _WHY)
        buffers = ctx.kv_pool.buffers[layer]
        pieces: list[tuple] = []
        q_starts, k_starts = accumulate(ctx.seq_lens_q, initial=0), accumulate(ctx.seq_lens_k, initial=0)
        with module_island_mode():
            for q0, k0, len_q, prefix in zip(q_starts, k_starts, ctx.seq_lens_q, ctx.prefix_lens):
                len_k, r = prefix + len_q, slice(q0, q0 + len_q)
                read = ctx.read_slots[k0 : k0 + len_k] if ctx.has_prefix else ctx.write_slots[r]
                mask = torch.ones(len_q, len_k, dtype=torch.bool, device=hidden_states.device).tril(prefix)
                prev = None if prev_topk_indices is None else prev_topk_indices[:, r, : min(topk, len_k)]
                pieces.append(run(hidden_states[:, r], cos[:, r], sin[:, r], mask[None, None],
                                  None if position_ids is None else position_ids[:, r], prev,
                                  RequestCache(buffers, ctx.write_slots[r], read), kwargs))
        return _concat(pieces, rows, ctx.num_tokens)

    dsa_attention.__qualname__ = f"dsa_attention[{path}]"
    return eager_on_graph(dsa_attention)


def _pad_topk(out: tuple, topk: int) -> tuple:
    """Fixed shapes for the boundary: top-k indices padded to ``index_topk`` by repeating the first pick (a repeated
    pick selects nothing new)."""
    fixed = []
    for t in out:
        if isinstance(t, Tensor) and t.dtype in (torch.int32, torch.int64) and t.shape[-1] < topk:
            t = torch.cat([t, t[..., :1].expand(*t.shape[:-1], topk - t.shape[-1])], dim=-1)
        fixed.append(t)
    return tuple(fixed)


def _concat(pieces: list[tuple], rows: int, num_tokens: int) -> tuple:
    """Per-request outputs back onto the packed rows; padded rows are zeros."""
    result: list[Tensor | None] = []
    for parts in zip(*pieces):
        if parts[0] is None:
            result.append(None)
            continue
        packed = torch.cat(parts, dim=1)
        if rows > num_tokens:
            packed = torch.cat([packed, packed.new_zeros((packed.shape[0], rows - num_tokens, *packed.shape[2:]))],
                               dim=1)
        result.append(packed)
    return tuple(result)
