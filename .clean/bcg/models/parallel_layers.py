"""Sharded layers of tensor parallel models, and which slice of each full weight a rank holds.

The usual Megatron split: a column-parallel linear holds a slice of the output features (the fused q/k/v and
gate/up projections, each part split on its own), a row-parallel linear a slice of the input features and sums the
partial products with one all-reduce, and the embedding and LM head hold a slice of the vocabulary (padded to a
multiple of the ranks). Every sharded parameter has a :class:`ShardSpec` that says which slice of the full tensor it
is, so random initialisation draws the full tensor and keeps the slice (the same weights as one process) and the
checkpoint loader reads only that slice from the safetensors files.

At one rank the factories return the plain ``nn.Linear`` / ``nn.Embedding`` of the single-device models: the same
modules, parameter names and kernels, and no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bcg.models.config import ModelConfig
from bcg.ops.parallel import TensorParallel

__all__ = ["ColumnParallelLinear", "Part", "RowParallelLinear", "ShardSpec", "VocabParallelEmbedding",
           "VocabParallelLMHead", "check_tensor_parallel", "column_linear", "embedding", "even_part", "lm_head",
           "row_linear", "shard_specs"]


@dataclass(frozen=True)
class Part:
    """One part of a fused dimension (q, k or v; gate or up): its full ``size`` and the rows ``[start, stop)`` this
    rank holds; rows at or past ``size`` are padding (zeros)."""

    size: int
    start: int
    stop: int


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of the full tensor a rank holds: along ``dim``, the concatenation of one range per part.

    Example:
        >>> spec = ShardSpec(0, (Part(4, 2, 4), Part(2, 1, 2)))    # rows 2-3 of part one, row 1 of part two
        >>> spec.take(torch.arange(6)).tolist(), spec.full_size
        ([2, 3, 5], 6)
    """

    dim: int
    parts: tuple[Part, ...]

    @property
    def full_size(self) -> int:
        return sum(p.size for p in self.parts)

    def take(self, full: Tensor) -> Tensor:
        """This rank's slice of the full tensor (padding rows zero)."""
        pieces, offset = [], 0
        for part in self.parts:
            pieces.append(take_rows(full, self.dim, part, offset))
            offset += part.size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


def take_rows(source: Tensor, dim: int, part: Part, offset: int = 0) -> Tensor:
    """Rows ``part.start:part.stop`` of the part starting at ``offset`` of ``source`` along ``dim``, zero-padded."""
    start, stop = min(part.start, part.size), min(part.stop, part.size)
    rows = source.narrow(dim, offset + start, stop - start)
    padding = (part.stop - part.start) - (stop - start)
    if padding == 0:
        return rows
    shape = list(rows.shape)
    shape[dim] = padding
    return torch.cat([rows, rows.new_zeros(shape)], dim=dim)


def even_part(size: int, tp: TensorParallel) -> Part:
    """``size`` rows split evenly over the ranks (``size`` divisible by ``tp.size``)."""
    return Part(size, *tp.shard(size))


def _padded_part(size: int, tp: TensorParallel) -> Part:
    per = -(-size // tp.size)
    return Part(size, tp.rank * per, (tp.rank + 1) * per)


class ColumnParallelLinear(nn.Module):
    """``x @ W_r.T + b_r``: this rank's output features of a (fused) projection; no communication.

    Example:
        >>> layer = ColumnParallelLinear(8, [Part(6, 0, 3), Part(6, 0, 3)], bias=False, tp=TensorParallel(2, 0))
        >>> layer(torch.randn(5, 8)).shape
        torch.Size([5, 6])
    """

    def __init__(self, in_features: int, parts: list[Part], bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        local = sum(p.stop - p.start for p in parts)
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        spec = ShardSpec(0, tuple(parts))
        self.shard_specs = {"weight": spec, "bias": spec} if bias else {"weight": spec}

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``sum over ranks of x_r @ W_r.T`` (+ bias once): input features sharded, one all-reduce of the output.

    The bias is replicated and added by rank 0 only, inside its matmul, so the sum holds it exactly once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        part = even_part(in_features, tp)
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, part.stop - part.start))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shard_specs = {"weight": ShardSpec(1, (part,))}
        self._adds_bias = bias and tp.rank == 0

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight, self.bias if self._adds_bias else None))


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows; other ids give zeros, and one all-reduce sums the ranks.

    The vocabulary is padded to a multiple of the ranks (padding rows are zero and no valid id reaches them).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        part = _padded_part(num_embeddings, tp)
        self.tp, self.start, self.num_local = tp, part.start, part.stop - part.start
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim))
        self.shard_specs = {"weight": ShardSpec(0, (part,))}

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[..., None], 0.0))


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered from every rank into the full vocabulary (eager)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        part = _padded_part(vocab_size, tp)
        self.tp, self.vocab_size = tp, vocab_size
        self.weight = nn.Parameter(torch.empty(part.stop - part.start, hidden_size))
        self.shard_specs = {"weight": ShardSpec(0, (part,))}

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_gather(F.linear(x, self.weight), dim=-1)[..., : self.vocab_size]


def column_linear(in_features: int, parts: list[Part], bias: bool, tp: TensorParallel) -> nn.Module:
    """A column-parallel projection of the fused ``parts``; at one rank the plain ``nn.Linear``."""
    if not tp.is_parallel:
        return nn.Linear(in_features, sum(p.size for p in parts), bias=bias)
    return ColumnParallelLinear(in_features, parts, bias, tp)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> nn.Module:
    """A row-parallel projection (all-reduce of its output); at one rank the plain ``nn.Linear``."""
    if not tp.is_parallel:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Module:
    """The token embedding, vocabulary-parallel across ranks; at one rank the plain ``nn.Embedding``."""
    return VocabParallelEmbedding(vocab_size, hidden_size, tp) if tp.is_parallel else nn.Embedding(vocab_size,
                                                                                                   hidden_size)


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallel) -> nn.Module:
    """The LM head, vocabulary-parallel with a gather of the logits; at one rank the plain ``nn.Linear``."""
    if not tp.is_parallel:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return VocabParallelLMHead(hidden_size, vocab_size, tp)


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Parameter name -> :class:`ShardSpec` of every sharded parameter of ``model`` (empty at one rank)."""
    specs = {}
    for prefix, module in model.named_modules():
        for name, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raises ValueError, naming the dimension and the sizes that work, unless ``size`` ranks can shard ``config``.

    Query heads and the FFN's intermediate size must divide by ``size``; KV heads must divide by it, or divide it
    (then each KV head is replicated on ``size // num_kv_heads`` ranks). The vocabulary is padded, so any size fits.

    Example:
        >>> from bcg.models.config import get_preset
        >>> check_tensor_parallel(get_preset("gptoss-moe"), 8)    # 16 heads, 2 KV heads replicated 4 times
        >>> check_tensor_parallel(get_preset("tiny-dense"), 3)
        Traceback (most recent call last):
        ...
        ValueError: tp_size=3 does not divide num_heads=4 of this model; use a tp_size that divides it: 1, 2, 4
    """
    if size == 1:
        return
    dims = {"num_heads": config.num_heads}
    if config.is_moe:
        dims["moe_intermediate_size"] = config.moe_intermediate_size
    else:
        dims["intermediate_size"] = config.intermediate_size
    for name, value in dims.items():
        if value % size:
            fits = ", ".join(str(d) for d in range(1, value + 1) if value % d == 0 and d <= 64)
            raise ValueError(f"tp_size={size} does not divide {name}={value} of this model; use a tp_size that "
                             f"divides it: {fits}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tp_size={size} neither divides num_kv_heads={kv} nor is a multiple of it, so KV heads "
                         f"can be neither split nor replicated evenly; use a divisor or a multiple of {kv}")
