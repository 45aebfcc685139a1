"""The interface every model implements, and :func:`build_model`.

A prefill step is split in three so the runner can capture the middle part:

* :meth:`CausalLM.embed` (eager) turns the real token ids into hidden states;
* :meth:`CausalLM.forward_layers` (captured) runs the layer stack on ``num_padded_tokens`` rows;
  it holds only fixed-shape tensor ops plus calls to ``@eager_on_graph`` islands, which are the
  only places that read the live batch (real token count, request boundaries, KV slots);
* :meth:`CausalLM.compute_logits` (eager) applies the final norm and the LM head to the rows the
  runner picked (one per request), in fp32.

Models are built by :func:`bcg.models.registry.build_model` (random weights) or
:func:`bcg.models.loader.load_checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bcg.models.config import ModelConfig
from bcg.models.layers import RMSNorm, RotaryEmbedding
from bcg.models.parallel_layers import check_tensor_parallel, embedding, lm_head, shard_specs
from bcg.models.regions import LayerIds, run_layer
from bcg.ops.kv_cache import KVPool
from bcg.ops.parallel import SINGLE, TensorParallel, kv_head_range

INIT_STD = 0.02


@dataclass(frozen=True)
class RankKVShape:
    """The KV pool dimensions of one tensor parallel rank (a :class:`bcg.ops.kv_cache.KVShape`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_index_groups: int
    index_head_dim: int


class CausalLM(nn.Module):
    """Base class of the model zoo: embedding, a layer stack, final norm and LM head.

    Subclasses fill ``self.layers`` with modules called as ``layer(hidden, residual, rope)`` (returning the
    sublayer output and the residual stream, see :class:`bcg.models.dense.DecoderLayer`) or override
    :meth:`forward_layers`. Build instances with :func:`bcg.models.registry.build_model` or
    :func:`bcg.models.loader.load_checkpoint` rather than directly: they materialise the weights
    on the target device and tie the embeddings. With a parallel ``tp`` every layer holds this rank's shard
    (:mod:`bcg.models.parallel_layers`) and every rank computes the same hidden states and logits.

    Example::

        model = build_model(get_preset("tiny-dense"), "cpu", torch.float32, seed=0)
        pool = KVPool.for_model(model.config, num_slots=16, device="cpu", dtype=torch.float32)
        batch = PrefillBatch([PrefillItem([1, 2, 3], new_slots=pool.alloc(3))], pool)
        with forward_context(batch.to_context(batch.num_tokens)):
            hidden = model.forward_layers(model.embed(batch.input_ids), batch.positions)
        model.compute_logits(hidden[batch.logits_indices]).shape      # (1, 256)
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_tensor_parallel(config, tp.size)
        self.config, self.tp = config, tp
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()

    @property
    def kv_shape(self) -> ModelConfig | RankKVShape:
        """What this rank's KV pool is sized by: the config, with this rank's KV heads under tensor parallel."""
        if not self.tp.is_parallel:
            return self.config
        c = self.config
        start, stop = kv_head_range(c.num_kv_heads, self.tp)
        return RankKVShape(c.num_layers, stop - start, c.head_dim, c.num_index_groups, c.index_head_dim)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config asks for it."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids ``(T,)`` -> hidden states ``(T, hidden_size)``. Eager part."""
        return self.embed_tokens(input_ids)

    def forward_layers(self, hidden: Tensor, positions: Tensor, out: Tensor | None = None) -> Tensor:
        """Run the layer stack on ``(T_pad, hidden_size)`` rows (written into ``out`` when given). Captured part.

        Rows past the real token count are padding: they flow through the dense ops like any row
        but the attention islands ignore them and never let them touch the KV pool. Needs a
        :func:`bcg.ops.context.forward_context` around the call. Each layer runs through
        :func:`bcg.models.regions.run_layer`, so a compiled stack compiles one layer per structure.
        """
        rope = self.rotary.rope(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = run_layer(layer, LayerIds(attention=i), hidden, residual, rope)
        if hidden.dim() == residual.dim() + 1:  # the last MLP's split-K partials (bcg.ops.kernels.down_partials)
            hidden = hidden.sum(0)  # fp32; the add below rounds once, as the add + RMSNorm kernel does
            if out is None:
                return (residual + hidden).to(residual.dtype)
        return torch.add(hidden, residual, out=out)  # straight into out: no copy after (a graph node fewer)

    def compute_logits(self, hidden_last: Tensor, out: Tensor | None = None) -> Tensor:
        """Final norm + LM head on ``(R, hidden_size)`` rows -> fp32 logits ``(R, vocab_size)``, written into ``out``
        when given (and returned). A one-rank head in fp32 writes ``out`` straight from its matmul: no ``(R, vocab)``
        temporary, which a captured graph would otherwise hold for the engine's life, one per bucket."""
        normed = self.norm(hidden_last)
        head = self.lm_head
        if out is not None and type(head) is nn.Linear and head.weight.dtype == out.dtype == normed.dtype:
            return torch.mm(normed, head.weight.t(), out=out)
        logits = head(normed)
        # With ``out``: the cast to fp32 is the copy itself, one kernel. A cast first and a same-dtype copy after
        # cost a kernel more and put a device-to-device memcpy into the graph, which CUDA may run as a copy-engine
        # node rather than a kernel (benchmarks/graph_nodes.py counts a graph's nodes by type).
        return logits.float() if out is None else out.copy_(logits)

    def make_kv_pool(self, num_slots: int, device: torch.device | str, dtype: torch.dtype) -> KVPool:
        """The KV pool this model's islands read and write, for ``num_slots`` cached tokens.

        Example:
            >>> from bcg.models.config import get_preset
            >>> from bcg.models.registry import build_model
            >>> build_model(get_preset("tiny-dense")).make_kv_pool(16, "cpu", torch.float32).k[0].shape
            torch.Size([17, 2, 16])
        """
        return KVPool.for_model(self.kv_shape, num_slots, device, dtype)

    def set_kernels(self, impl: str) -> None:
        """Runs the non-matmul ops with ``impl``: ``"torch"`` (plain torch ops) or ``"fused"`` (the fused kernels of
        :mod:`bcg.ops.kernels`: Triton on CUDA, the same references on a CPU), in every module that has both.

        Example:
            >>> from bcg.models.config import get_preset
            >>> from bcg.models.registry import build_model
            >>> model = build_model(get_preset("tiny-dense"))
            >>> model.set_kernels("fused"); model.layers[0].mlp.kernels
            'fused'
        """
        if impl not in ("fused", "torch"):
            raise ValueError(f"kernels must be 'fused' or 'torch', got {impl!r}")
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = impl

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic random init: N(0, 0.02) matrices, unit norm scales, zero biases.

        Parameters are visited in registration order, so one seed always gives the same weights
        on a given device type. A sharded parameter draws the full tensor and keeps its slice, so every
        ``tp_size`` gives the weights of one process.
        """
        specs = shard_specs(self)
        for name, param in self.named_parameters():
            spec = specs.get(name)
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            elif spec is None:
                param.normal_(0.0, INIT_STD, generator=generator)
            else:
                shape = list(param.shape)
                shape[spec.dim] = spec.full_size
                full = torch.empty(shape, dtype=param.dtype, device=param.device)
                param.copy_(spec.take(full.normal_(0.0, INIT_STD, generator=generator)))

    def post_init(self) -> None:
        """Fix-ups after the weights land on their device; subclasses may extend it."""
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters()
