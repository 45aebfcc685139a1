"""Dense decoder: GQA attention with RoPE (optional Qwen3 q/k norm and bias) and a SwiGLU MLP.

The attention and decoder-layer modules here are reused by the MoE and DSA models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from bcg import env
from bcg.models.base import CausalLM
from bcg.models.config import ModelConfig
from bcg.models.layers import RMSNorm, Rope, SwiGLUMLP, apply_rotary, rotate
from bcg.models.parallel_layers import Part, column_linear, even_part, row_linear
from bcg.ops import bridge
from bcg.ops import kernels as fused
from bcg.ops.attention import attention, kv_destination
from bcg.ops.parallel import SINGLE, TensorParallel, kv_head_range
from bcg.ops.region_islands import region_attention


class QKVProjection(nn.Module):
    """Fused q/k/v projection, optional per-head q/k RMSNorm, then RoPE.

    Returns ``q (T, num_heads, head_dim)``, ``k, v (T, num_kv_heads, head_dim)``. With fused kernels the split,
    the norms, the rotation and the copies into the island's inputs are one kernel after the projection, or (short
    prompts, one rank) the projection's own epilogue. Tensor parallel: column-parallel by heads, each rank its share
    of the query heads and the KV heads they read (``num_heads`` and ``num_kv_heads`` are then this rank's counts).

    Example:
        >>> from bcg.models.config import get_preset
        >>> from bcg.models.layers import RotaryEmbedding
        >>> cfg = get_preset("tiny-dense")
        >>> rope = RotaryEmbedding(cfg.head_dim).rope(torch.arange(3))
        >>> q, k, v = QKVProjection(cfg)(torch.randn(3, cfg.hidden_size), rope)
        >>> q.shape, k.shape
        (torch.Size([3, 4, 16]), torch.Size([3, 2, 16]))
    """

    kernels: str = "torch"

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        dim = self.head_dim = config.head_dim
        q_part = even_part(config.num_heads * dim, tp)
        kv_start, kv_stop = kv_head_range(config.num_kv_heads, tp)
        kv_part = Part(config.num_kv_heads * dim, kv_start * dim, kv_stop * dim)
        self.num_heads, self.num_kv_heads = (q_part.stop - q_part.start) // dim, kv_stop - kv_start
        # One matmul for q, k and v: fewer launches than three separate projections.
        self.qkv_proj = column_linear(config.hidden_size, [q_part, kv_part, kv_part], config.attention_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        return self.carried(x, rope)

    def rotated(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``(qk, v)``: q heads then k heads after norm and RoPE, ``(T, heads + kv_heads, head_dim)``, and ``v`` in
        ``x.dtype``. Without q/k norms, q and k sit side by side in the fused projection and rotate in one pass,
        and ``qk`` stays fp32 (the caller's copy casts it); with them, ``qk`` is already ``x.dtype``."""
        num_rows, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (heads + kv_heads) * dim].view(num_rows, heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(num_rows, kv_heads, dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Normed q and k are rotated and rounded apart, as in eager reference code: fused across the cat,
            # Inductor would skip the rounding of the norms' outputs and drift further from eager.
            q = apply_rotary(self.q_norm(qk[:, :heads]), cos, sin)
            return torch.cat((q, apply_rotary(self.k_norm(qk[:, heads:]), cos, sin)), dim=1), v
        return rotate(qk, cos, sin), v

    def carried(self, x: Tensor, rope: Rope, cache: tuple[Tensor, Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` in ``x.dtype`` for an attention island: while the runner captures they live in bridge
        buffers shared by all layers and buckets (:mod:`bcg.ops.bridge`), and the fp32 RoPE result is cast in the
        copy into them (or the fused kernel writes them there directly); otherwise they are plain tensors. With
        ``cache`` (fused kernels only: :func:`bcg.ops.attention.kv_destination`) the kernel also writes k and v into
        the KV pool."""
        if self.kernels == "fused":
            out, norms = self._fused_args(x)
            if type(self.qkv_proj) is nn.Linear:  # one rank: at short prompts the projection's epilogue does the rest
                return fused.qkv_proj_rope(x, self.qkv_proj.weight, self.qkv_proj.bias, rope.positions, rope.inv_freq,
                                           self.num_heads, self.num_kv_heads, out=out, impl="fused", cache=cache,
                                           **norms)
            return fused.qkv_norm_rope(self.qkv_proj(x), rope.positions, rope.inv_freq, self.num_heads,
                                       self.num_kv_heads, out=out, impl="fused", cache=cache, **norms)
        qk, v = bridge.carry("attn", *self.rotated(x, rope.cos, rope.sin), dtype=x.dtype)
        return (*qk.split([self.num_heads, self.num_kv_heads], dim=1), v)

    def carried_normed(self, x: Tensor, residual: Tensor | None, norm: RMSNorm, rope: Rope,
                       cache: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`carried` of ``norm(x + residual)`` (of ``norm(x)`` when ``residual`` is None), and that sum, the
        layer's residual stream (``x`` itself without ``residual``: read, never written). The add and the norm run
        in the q/k/v kernel's prologue where :func:`~bcg.ops.kernels.qkv_proj_rope` runs its one kernel (up to 16
        rows), else as the add + norm kernel before it. Fused kernels on one rank only."""
        out, norms = self._fused_args(x)
        args = (x, self.qkv_proj.weight, self.qkv_proj.bias, rope.positions, rope.inv_freq, self.num_heads,
                self.num_kv_heads)
        if residual is None:
            q, k, v = fused.qkv_proj_rope(*args, out=out, impl="fused", cache=cache, norm_weight=norm.weight,
                                          norm_eps=norm.eps, **norms)
            return q, k, v, x
        return fused.qkv_proj_rope(*args, out=out, impl="fused", cache=cache, residual=residual,
                                   norm_weight=norm.weight, norm_eps=norm.eps, **norms)

    def _fused_args(self, x: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], dict]:
        """The fused kernels' ``out`` (bridge buffers while the runner captures) and per-head norm arguments."""
        rows, dim, kw = x.shape[0], self.head_dim, {"dtype": x.dtype, "device": x.device}
        out = (bridge.empty("attn.q", (rows, self.num_heads, dim), **kw),
               bridge.empty("attn.k", (rows, self.num_kv_heads, dim), **kw),
               bridge.empty("attn.v", (rows, self.num_kv_heads, dim), **kw))
        has_norm = self.q_norm is not None and self.k_norm is not None
        norms = {"q_weight": self.q_norm.weight if has_norm else None,
                 "k_weight": self.k_norm.weight if has_norm else None, "eps": self.q_norm.eps if has_norm else 1e-6}
        return out, norms


class Attention(nn.Module):
    """Causal GQA self-attention whose core runs in the :func:`bcg.ops.attention.attention` island.

    Example:
        >>> from bcg.models.config import get_preset
        >>> Attention(get_preset("tiny-dense"), layer_id=0).o_proj.in_features
        64
    """

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv = QKVProjection(config, tp)
        self.o_proj = row_linear(config.num_heads * config.head_dim, config.hidden_size, config.attention_bias, tp)

    def forward(self, x: Tensor, rope: Rope, bcg_region: bool = False) -> Tensor:
        return self.o_proj(self.heads(x, rope, bcg_region))

    def heads(self, x: Tensor, rope: Rope, bcg_region: bool = False) -> Tensor:
        """The attention's output before the o projection, ``(T, num_heads * head_dim)``."""
        # With the fused kernels the RoPE kernel writes this layer's K/V into the pool too: two launches fewer.
        dest = kv_destination(self.layer_id) if self.qkv.kernels == "fused" and not bcg_region else None
        q, k, v = self.qkv.carried(x, rope, cache=dest)
        return self._attend(q, k, v, dest is not None, bcg_region)

    def heads_normed(self, x: Tensor, residual: Tensor | None, norm: RMSNorm, rope: Rope) -> tuple[Tensor, Tensor]:
        """:meth:`heads` of ``norm(x + residual)``, with the add and the norm in the q/k/v kernel
        (:meth:`QKVProjection.carried_normed`; fused kernels on one rank), and the sum: ``(heads, residual)``."""
        q, k, v, residual = self.qkv.carried_normed(x, residual, norm, rope, cache=kv_destination(self.layer_id))
        return self._attend(q, k, v, True, False), residual

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, kv_stored: bool, bcg_region: bool) -> Tensor:
        out = bridge.output_like("attn", q)  # a shared bridge buffer while the runner captures, else a fresh tensor
        if bcg_region:  # a compiled region shared by every layer: the island learns its layer when it runs
            region_attention(q, k, v, out)
        else:
            attention(q, k, v, out, self.layer_id, kv_stored=kv_stored)
        return out.flatten(1)


def folds_post_attention_norm(layer: DecoderLayer, bcg_region: bool = False) -> bool:
    """Whether ``layer`` runs without a post-attention add + RMSNorm kernel (``BCG_NORM_FUSION=on``,
    :mod:`bcg.env`): the residual add in the o projection's GEMM, the norm folded into the gate/up kernel.

    Only where that is the layer's arithmetic up to rounding and the kernels exist: dense attention whose o
    projection is one plain bias-free ``nn.Linear`` (one rank: under tensor parallel an all-reduce follows it, and
    the residual must not be added on every rank before the sum), a :class:`SwiGLUMLP` on the fused kernels with
    ``BCG_MLP_FUSION=gate_up`` (the kernel the norm folds into), and no compiled region (``bcg_region``: the
    region's compiled layer stays the one structure every layer shares). On a CPU the gate/up entry point then runs
    ``rms_norm`` and the two steps, so the CPU tests run the same wiring.

    Example:
        >>> from bcg.models.config import get_preset
        >>> cfg = get_preset("tiny-dense")
        >>> layer = DecoderLayer(cfg, Attention(cfg, 0), SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size))
        >>> folds_post_attention_norm(layer)  # the torch kernels (and BCG_NORM_FUSION is off by default)
        False
    """
    if not env.NORM_FUSION or bcg_region:  # the switch first: off, the hot path asks nothing more
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (isinstance(attn, Attention) and type(attn.o_proj) is nn.Linear and attn.o_proj.bias is None
            and isinstance(mlp, SwiGLUMLP) and mlp.kernels == "fused" and env.MLP_FUSION == "gate_up"
            and mlp.gate_up_proj.bias is None)


def folds_input_norm(layer: DecoderLayer) -> bool:
    """Whether a folded layer (:func:`folds_post_attention_norm`) also runs its input add + RMSNorm in the q/k/v
    kernel's prologue (``BCG_INPUT_NORM_FUSION=on``): its q/k/v projection is on the fused kernels, one rank."""
    qkv = layer.self_attn.qkv
    return env.INPUT_NORM_FUSION and qkv.kernels == "fused" and type(qkv.qkv_proj) is nn.Linear


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += ffn(norm(h))``.

    The residual stream is carried beside the sublayer output, so each add and the norm after it are one step
    (one kernel when fused): ``layer(hidden, residual, rope) -> (ffn_out, residual)``, ``residual=None`` in the
    first layer, whose input (a graph's static input) is read and never written. The stack adds the two at the end.
    Where :func:`folds_post_attention_norm` says so, the post-attention step is no kernel of its own: the o
    projection adds the residual in its GEMM and the MLP folds the norm into its gate/up kernel.

    Example:
        >>> from bcg.models.config import get_preset
        >>> cfg = get_preset("tiny-dense")
        >>> layer = DecoderLayer(cfg, Attention(cfg, 0), SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size))
        >>> isinstance(layer.mlp, SwiGLUMLP)
        True
    """

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, hidden: Tensor, residual: Tensor | None, rope: Rope,
                bcg_region: bool = False) -> tuple[Tensor, Tensor]:
        if folds_post_attention_norm(self, bcg_region):
            return self.folded(hidden, residual, rope)
        if residual is None:
            attn_out = self.self_attn(self.input_layernorm(hidden), rope, bcg_region)
            normed, residual = self.post_attention_layernorm.add(attn_out, hidden, inplace=False)
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
            normed, residual = self.post_attention_layernorm.add(self.self_attn(normed, rope, bcg_region), residual)
        return self.mlp(normed), residual

    def folded(self, hidden: Tensor, residual: Tensor | None, rope: Rope) -> tuple[Tensor, Tensor]:
        """:meth:`forward` with the post-attention add + RMSNorm folded away (:func:`folds_post_attention_norm`).

        ``residual + o_proj(attn)`` is one cuBLAS GEMM with beta=1, in place on the residual the layer owns (in the
        first layer out of place on ``hidden``, which must not be written); it rounds the sum once where the unfused
        layer rounds the projection and then the sum. The MLP gets the residual itself with the norm's weight. Where
        :func:`folds_input_norm` says so, the input add + norm runs in the q/k/v kernel's prologue as well."""
        attn, norm = self.self_attn, self.post_attention_layernorm
        if folds_input_norm(self):  # the input add + norm in the q/k/v kernel: the sum is a new tensor (or hidden)
            heads, residual = attn.heads_normed(hidden, residual, self.input_layernorm, rope)
            is_input = residual is hidden
        elif residual is None:
            heads, residual, is_input = attn.heads(self.input_layernorm(hidden), rope), hidden, True
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
            heads, is_input = attn.heads(normed, rope), False
        if is_input:  # the first layer's residual is its input, a graph's static input: never written
            residual = torch.addmm(residual, heads, attn.o_proj.weight.t())
        else:
            residual.addmm_(heads, attn.o_proj.weight.t())
        return self.mlp(residual, norm.weight, norm.eps), residual


class DenseLM(CausalLM):
    """Llama/Qwen3-style dense model (``arch="dense"``).

    Example:
        >>> from bcg.models.config import get_preset
        >>> len(DenseLM(get_preset("tiny-dense")).layers)
        2
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE,
                 make_mlp: Callable[[ModelConfig, TensorParallel], nn.Module] | None = None) -> None:
        super().__init__(config, tp)
        make_mlp = make_mlp or (lambda cfg, tp: SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, tp))
        self.layers.extend(DecoderLayer(config, Attention(config, layer_id, tp), make_mlp(config, tp))
                           for layer_id in range(config.num_layers))
        # What follows each MLP takes its down projection's split-K partials (bcg.ops.kernels.down_partials): the
        # next layer's add + RMSNorm, or the stack's last add (forward_layers). Every layer alike, so a compiled
        # stack keeps one structure (SwiGLUMLP asks BCG_INPUT_NORM_FUSION, under which the q/k/v kernel takes it).
        for layer in self.layers:
            if isinstance(layer.mlp, SwiGLUMLP):
                layer.mlp.emits_partials = True
