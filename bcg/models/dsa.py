"""DSA model: attention restricted to keys picked by a lightweight indexer (DeepSeek/GLM style).

The first layer of each group of ``index_share`` layers computes the selection with its :class:`Indexer` and turns
it into a pick plan; the others reuse the plan. Only the indexer's top-k is an island (:mod:`bcg.ops.dsa`): it reads
the live batch. The plan and every layer's sparse attention have fixed shapes, so a graph segment captures them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bcg.models.base import CausalLM
from bcg.models.config import ModelConfig
from bcg.models.dense import DecoderLayer, QKVProjection
from bcg.models.layers import Rope, SwiGLUMLP
from bcg.models.moe import MoEFFN, prepare_experts
from bcg.models.parallel_layers import row_linear
from bcg.models.regions import LayerIds, run_layer
from bcg.ops.bridge import carry, output_like
from bcg.ops.dsa import pick_plan, select_topk, sparse_attention
from bcg.ops.kernels.dsa_topk import warm_index_topk
from bcg.ops.parallel import SINGLE, TensorParallel
from bcg.ops.region_islands import region_select_topk, region_sparse_attention


class Indexer(nn.Module):
    """Lightweight scorer that picks, per query, the keys its group's layers attend to.

    Example:
        >>> from bcg.models.config import get_preset
        >>> Indexer(get_preset("tiny-dsa"), group_id=0).topk
        8
    """

    def __init__(self, config: ModelConfig, group_id: int) -> None:
        super().__init__()
        self.group_id, self.topk = group_id, config.index_topk
        self.kernels = "torch"  # the top-k island's: CausalLM.set_kernels sets every module's
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.split_sizes = [self.num_heads * self.head_dim, self.head_dim, self.num_heads]
        # Index queries, index key and head weights from one matmul.
        self.proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)

    def forward(self, x: Tensor, bcg_region: bool = False) -> Tensor:
        index_q, index_k, head_weights = self.proj(x).split(self.split_sizes, dim=-1)
        index_q = index_q.reshape(x.shape[0], self.num_heads, self.head_dim)
        index_q, index_k, head_weights = carry("index", index_q, index_k, head_weights)
        if bcg_region:  # a compiled region: the island learns its group when it runs
            return region_select_topk(index_q, index_k, head_weights, self.topk, self.kernels)
        return select_topk(index_q, index_k, head_weights, self.group_id, self.topk, self.kernels)


class SparseAttention(nn.Module):
    """GQA attention over indexer-selected keys; layer ``i`` owns an indexer iff ``i % index_share == 0``.

    Tensor parallel shards the heads as dense attention does; the indexer is small and replicated, so every rank
    selects the same keys.

    Example:
        >>> from bcg.models.config import get_preset
        >>> cfg = get_preset("tiny-dsa")
        >>> SparseAttention(cfg, 4).indexer is not None, SparseAttention(cfg, 5).indexer is None
        (True, True)
    """

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv = QKVProjection(config, tp)
        self.o_proj = row_linear(config.num_heads * config.head_dim, config.hidden_size, config.attention_bias, tp)
        is_group_leader = layer_id % config.index_share == 0
        self.indexer = Indexer(config, layer_id // config.index_share) if is_group_leader else None

    def forward(self, x: Tensor, rope: Rope, plan: list[Tensor] | None,
                bcg_region: bool = False) -> tuple[Tensor, list[Tensor]]:
        if self.indexer is not None:  # the group's selection, laid out once for all its layers
            plan = pick_plan(self.indexer(x, bcg_region), x)
        if plan is None:
            raise RuntimeError(f"layer {self.layer_id} has no indexer and was given no pick plan")
        q, k, v = self.qkv.carried(x, rope)  # shared bridge buffers while capturing
        out = output_like("attn", q)
        if bcg_region:
            region_sparse_attention(q, k, v, plan, out)
        else:
            sparse_attention(q, k, v, plan, out, self.layer_id)
        return self.o_proj(out.flatten(1)), plan


class SparseDecoderLayer(DecoderLayer):
    """Pre-norm block around :class:`SparseAttention`; threads the residual stream and the pick plan through."""

    def forward(  # type: ignore[override]
        self, hidden: Tensor, residual: Tensor | None, rope: Rope, plan: list[Tensor] | None, bcg_region: bool = False
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        if residual is None:  # the first layer reads the stack's input and never writes it
            attn_out, plan = self.self_attn(self.input_layernorm(hidden), rope, plan, bcg_region)
            normed, residual = self.post_attention_layernorm.add(attn_out, hidden, inplace=False)
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
            attn_out, plan = self.self_attn(normed, rope, plan, bcg_region)
            normed, residual = self.post_attention_layernorm.add(attn_out, residual)
        return self.mlp(normed), residual, plan


class DSALM(CausalLM):
    """GLM-5-like model (``arch="dsa"``): indexer-selected sparse attention, MoE or dense FFN.

    Example:
        >>> from bcg.models.config import get_preset
        >>> sum(layer.self_attn.indexer is not None for layer in DSALM(get_preset("tiny-dsa")).layers)
        2
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp)
        for layer_id in range(config.num_layers):
            mlp = MoEFFN(config, tp) if config.is_moe else SwiGLUMLP(config.hidden_size, config.intermediate_size, tp)
            self.layers.append(SparseDecoderLayer(config, SparseAttention(config, layer_id, tp), mlp))

    def warm_islands(self, max_keys: int) -> list[str]:
        """Compiles the fused top-k for every sort width key ranges up to ``max_keys`` need (:func:`warm_index_topk`):
        Triton compiles a variant at its first call, seconds no request should pay. Returns the build's note."""
        indexer = self.layers[0].self_attn.indexer
        if indexer.kernels != "fused":
            return []
        weight = indexer.proj.weight
        widths = warm_index_topk(weight.device, weight.dtype, indexer.num_heads, indexer.head_dim, indexer.topk,
                                 max_keys)
        return [f"DSA top-k kernel compiled for key ranges up to {widths[-1]}"] if widths else []

    def forward_layers(self, hidden: Tensor, positions: Tensor, out: Tensor | None = None) -> Tensor:
        rope = self.rotary.rope(positions)
        residual: Tensor | None = None
        plan: list[Tensor] | None = None
        for i, layer in enumerate(self.layers):
            ids = LayerIds(attention=i, index_group=getattr(layer.self_attn.indexer, "group_id", None))
            hidden, residual, plan = run_layer(layer, ids, hidden, residual, rope, plan)
        return torch.add(hidden, residual, out=out)

    def post_init(self) -> None:
        super().post_init()
        prepare_experts(self)
