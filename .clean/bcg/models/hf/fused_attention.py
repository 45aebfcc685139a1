"""A transformers attention module as one q/k/v GEMM, one kernel for the q/k norm and RoPE, bcg's attention island
and the output projection.

:class:`FusedAttention` replaces an attention module whose structure :mod:`bcg.models.hf.fusion` recognised (q/k/v
projections or one qkv projection, an output projection, optional q/k RMSNorms per head or over the whole
projection, optional attention sinks) and whose features the probe recorded (scale, sliding window, soft-cap,
sinks). The fused kernel writes q, k and v straight into the island's inputs (bcg's bridge buffers while the runner
captures), as the native models' attention does.

RoPE goes by the kernel's rotate-half layout, ``x * cos + rotate_half(x) * sin`` over the whole head, with angles
``position * inv_freq`` computed from the layer's ``position_ids``. Two variants are honoured exactly:

* partial rotary (a rotary dimension ``R < head_dim``: glm4_moe, phi3 variants): q and k rows are stored permuted
  per head so that the rotated pairs ``(i, i + R/2)`` land on the kernel's ``(j, j + D/2)`` and the pass-through
  dimensions on pairs whose frequency is 0 (a rotation by 0 is exact). q and k are permuted alike, so their dot
  products, and the attention, do not change; the pool keeps k in that order, which only this layer reads;
* an attention scaling of the cos/sin tables (yarn's ``attention_factor``: gpt_oss): q and k are each scaled by
  ``s``, so the scores by ``s**2``; the kernel rotates without it and the softmax scale takes the ``s**2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.models.hf import UnsupportedModelError
from bcg.models.hf.fused_layer import FusedModule, NormSpec
from bcg.models.hf.joined import JoinedWeight, head_rows
from bcg.ops import bridge
from bcg.ops import kernels as fused
from bcg.ops.attention import attention, kv_destination
from bcg.ops.region_islands import region_attention

__all__ = ["AttentionSpec", "FusedAttention", "RopeLayout", "rope_layout"]


@dataclass(frozen=True)
class RopeLayout:
    """How the kernel rotates one layer's q and k: its ``inv_freq`` (``head_dim / 2``, fp32, zeros for pass-through
    pairs), the per-head row order q and k are stored in (None: as the model's), and the tables' scaling."""

    inv_freq: Tensor
    rows: Tensor | None
    scaling: float


def rope_layout(inv_freq: Tensor, head_dim: int, scaling: float) -> RopeLayout:
    """The kernel layout for a model's ``inv_freq`` (``R / 2`` entries for a rotary dimension ``R <= head_dim``).

    Example:
        >>> lay = rope_layout(torch.tensor([1.0, 0.5]), 8, 1.0)          # R = 4 of 8 dimensions rotate
        >>> lay.inv_freq.tolist(), lay.rows.tolist()
        ([1.0, 0.5, 0.0, 0.0], [0, 1, 4, 5, 2, 3, 6, 7])
    """
    inv_freq = inv_freq.detach().float()
    half, rot_half = head_dim // 2, inv_freq.numel()
    if rot_half == half:
        return RopeLayout(inv_freq, None, scaling)
    if rot_half > half or head_dim % 2:
        raise ValueError(f"inv_freq has {rot_half} entries for head_dim {head_dim}")
    dev = inv_freq.device
    pass_half = half - rot_half
    rot = 2 * rot_half
    # kernel pair j (j < D/2) is (j, j + D/2); model pair i (i < R/2) is (i, i + R/2), pass-through dims from R on.
    first = torch.cat([torch.arange(rot_half, device=dev), rot + torch.arange(pass_half, device=dev)])
    second = torch.cat([rot_half + torch.arange(rot_half, device=dev),
                        rot + pass_half + torch.arange(pass_half, device=dev)])
    padded = torch.cat([inv_freq, inv_freq.new_zeros(pass_half)])
    return RopeLayout(padded, torch.cat([first, second]), scaling)


@dataclass
class AttentionSpec:
    """What :class:`FusedAttention` needs from its module and from the probe's record of its attention call."""

    projections: tuple[str, ...]  # ("q_proj", "k_proj", "v_proj") or ("qkv_proj",)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_idx: int
    rope: RopeLayout
    qk_norm: str | None  # None, "head" (per head, over head_dim) or "proj" (over the whole q / k projection)
    q_norm: NormSpec | None
    k_norm: NormSpec | None
    scale: float | None
    window: int | None
    softcap: float | None
    sinks: Tensor | None


class FusedAttention(FusedModule):
    """An attention module as the fused path (see the module doc); called as the module it replaces."""

    def __init__(self, original: nn.Module, spec: AttentionSpec) -> None:
        names = [*spec.projections, "o_proj"] + [n for n in ("q_norm", "k_norm") if spec.qk_norm]
        children = {n: getattr(original, n) for n in names}
        if isinstance(getattr(original, "sinks", None), nn.Parameter):
            children["sinks"] = original.sinks
        super().__init__(original, children)
        self.spec = spec
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        perm = spec.rope.rows
        q_rows = None if perm is None else head_rows(perm, heads)
        k_rows = None if perm is None else head_rows(perm, kv_heads)
        if len(spec.projections) == 3:
            q, k, v = (getattr(original, n) for n in spec.projections)
            weights = [q.weight, k.weight, v.weight]
            biases = [q.bias, k.bias, v.bias]
        else:
            qkv = getattr(original, spec.projections[0])
            weights, biases = [qkv.weight], [qkv.bias]
            if perm is not None:  # one parameter already: permute its q and k rows inside it
                rows = torch.cat([q_rows, heads * dim + k_rows,
                                  torch.arange((heads + kv_heads) * dim, qkv.weight.shape[0], device=perm.device)])
                q_rows, k_rows = rows, None
        rows = [q_rows, k_rows, None][: len(weights)]
        self.joined.append(JoinedWeight(weights, rows))
        self.qkv_weight = self.joined[-1].tensor
        self.qkv_bias = None
        if all(b is not None for b in biases):
            self.joined.append(JoinedWeight(biases, rows))
            self.qkv_bias = self.joined[-1].tensor
        elif any(b is not None for b in biases):  # some parts biased: zeros for the others (a new small tensor)
            parts = [b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)]
            self.qkv_bias = torch.cat([p if r is None else p[r] for p, r in zip(parts, rows)])
        self.q_weight = self.k_weight = None
        if spec.qk_norm is not None:
            self.q_weight, self.k_weight = (_permuted(n.weight, perm, spec.qk_norm == "head")
                                            for n in (spec.q_norm, spec.k_norm))
        self.sinks_fp32 = None if spec.sinks is None else spec.sinks.detach().float()
        scale = spec.scale if spec.scale is not None else dim ** -0.5
        scale *= spec.rope.scaling ** 2
        self.scale = None if scale == dim ** -0.5 else scale

    def forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        spec, impl = self.spec, self.kernels
        if attention_mask is not None:
            raise UnsupportedModelError(
                f"{type(self.original).__name__} (layer {spec.layer_idx}) received an attention mask: the model "
                "builds a mask of its own, which bcg cannot honour")
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise UnsupportedModelError(f"{type(self.original).__name__} (layer {spec.layer_idx}) was called without "
                                        "position_ids, which bcg's fused RoPE needs")
        x = hidden_states[0]
        rows, heads, kv_heads, dim = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias) if spec.qk_norm == "proj" else None
        if qkv is not None:  # olmo2: q and k normed over the whole projection, in place
            q_part, k_part = qkv[:, : heads * dim], qkv[:, heads * dim : (heads + kv_heads) * dim]
            fused.rms_norm(q_part, self.q_weight, spec.q_norm.eps, out=q_part, impl=impl)
            fused.rms_norm(k_part, self.k_weight, spec.k_norm.eps, out=k_part, impl=impl)
        kw = {"dtype": x.dtype, "device": x.device}
        out = (bridge.empty("hf_attn.q", (rows, heads, dim), **kw),
               bridge.empty("hf_attn.k", (rows, kv_heads, dim), **kw),
               bridge.empty("hf_attn.v", (rows, kv_heads, dim), **kw))
        per_head, in_region = spec.qk_norm == "head", bool(kwargs.get("bcg_region"))
        # As in the native models: with the fused kernels the RoPE kernel writes the layer's K/V into the pool too
        # (two launches fewer a layer); a compiled region shares its code between layers, so its island writes them.
        dest = kv_destination(spec.layer_idx) if impl == "fused" and not in_region else None
        norms = {"q_weight": self.q_weight if per_head else None, "k_weight": self.k_weight if per_head else None,
                 "eps": spec.q_norm.eps if per_head else 1e-6}
        if qkv is None:  # the projection and the rest in one kernel at short prompts (bcg.ops.kernels.qkv_rope)
            q, k, v = fused.qkv_proj_rope(x, self.qkv_weight, self.qkv_bias, position_ids[0], spec.rope.inv_freq,
                                          heads, kv_heads, out=out, impl=impl, cache=dest, **norms)
        else:
            q, k, v = fused.qkv_norm_rope(qkv, position_ids[0], spec.rope.inv_freq, heads, kv_heads, out=out,
                                          impl=impl, cache=dest, **norms)
        attn = bridge.empty("hf_attn.out", (rows, heads, dim), **kw)
        if in_region:  # a compiled region shared by layers: the island learns its layer when it runs
            region_attention(q, k, v, attn, self.scale, spec.window, spec.softcap, self.sinks_fp32)
        else:
            attention(q, k, v, attn, spec.layer_idx, self.scale, spec.window, spec.softcap, self.sinks_fp32,
                      kv_stored=dest is not None)
        return self.o_proj(attn.view(rows, heads * dim))[None], None


def _permuted(weight: Tensor, perm: Tensor | None, per_head: bool) -> Tensor:
    """A q/k norm's weight in the stored row order (a copy when permuted; norm weights are small)."""
    if perm is None:
        return weight
    if per_head:
        return weight.detach()[perm].contiguous()
    return weight.detach()[head_rows(perm, weight.numel() // perm.numel())].contiguous()
