"""Model configuration and the named presets of the model zoo.

A :class:`ModelConfig` describes the shape of a decoder-only model; it says nothing about dtype or
device (those are engine options), so one preset serves the CPU tests and the GPU benchmark alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Arch = Literal["dense", "moe", "dsa"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    ``arch`` picks the layer family: ``"dense"`` (GQA attention + SwiGLU MLP), ``"moe"`` (same
    attention, Qwen3-MoE style FFN) or ``"dsa"`` (attention restricted to keys chosen by a
    lightweight indexer; its FFN is MoE when ``num_experts > 0``, else dense).

    Example:
        >>> cfg = ModelConfig(arch="dense", vocab_size=256, hidden_size=64, num_layers=2,
        ...                   num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
        >>> cfg.num_queries_per_kv
        2
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Qwen3-style per-head RMSNorm on q and k, applied before RoPE.
    qk_norm: bool = False
    # Bias on q/k/v/o projections (Llama/Qwen3 semantics: all four or none).
    attention_bias: bool = False
    # MoE FFN (arch "moe", optionally "dsa").
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # DSA indexer (arch "dsa").
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # Each group of `index_share` consecutive layers reuses the selection of its first layer.
    index_share: int = 4

    def __post_init__(self) -> None:
        if self.arch not in ("dense", "moe", "dsa"):
            raise ValueError(f"unknown arch {self.arch!r}; expected 'dense', 'moe' or 'dsa'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.arch == "moe" or self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    "MoE needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0, got "
                    f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}, "
                    f"moe_intermediate_size={self.moe_intermediate_size}"
                )
        if self.arch == "dsa" and min(self.index_n_heads, self.index_head_dim, self.index_topk, self.index_share) <= 0:
            raise ValueError("arch 'dsa' needs positive index_n_heads, index_head_dim, index_topk and index_share")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        """Whether the FFN of every layer is a mixture of experts."""
        return self.num_experts > 0

    @property
    def num_index_groups(self) -> int:
        """Number of indexer groups (0 unless arch is ``"dsa"``); one index-key cache each."""
        return -(-self.num_layers // self.index_share) if self.arch == "dsa" else 0


_TINY = ModelConfig(
    arch="dense", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=128,
)

PRESETS: dict[str, ModelConfig] = {
    # CPU test sizes.
    "tiny-dense": _TINY,
    "tiny-moe": replace(
        _TINY, arch="moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    ),
    # 5 layers with index_share 4 gives two indexer groups (layers 0-3 and 4).
    "tiny-dsa": replace(
        _TINY, arch="dsa", num_layers=5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        index_n_heads=2, index_head_dim=16, index_topk=8, index_share=4,
    ),
    # GPU presets: small enough that prefill of a few hundred tokens is launch-bound on an H200 (eager wall time
    # well above the summed kernel time); hidden 1024-2048 and 24-28 layers, like the small models they mimic.
    # A 32k context (RoPE is computed on the fly): long-prompt chunked prefill is measured on it too.
    "llama-dense": ModelConfig(
        arch="dense", vocab_size=32000, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=4,
        head_dim=64, intermediate_size=2816, rms_norm_eps=1e-5, max_position_embeddings=32768,
    ),
    # The same architecture at TinyLlama width: at 512 tokens its kernels alone take about half of eager's wall
    # time on a fast host, so no graph method can be 3x faster there (BENCHMARKS.md shows both).
    "llama-dense-2k": ModelConfig(
        arch="dense", vocab_size=32000, hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=4,
        head_dim=128, intermediate_size=5632, rms_norm_eps=1e-5,
    ),
    # gpt-oss-like: many small experts, top-4, 8:1 GQA, attention bias, large RoPE base.
    "gptoss-moe": ModelConfig(
        arch="moe", vocab_size=32000, hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=2,
        head_dim=64, intermediate_size=2816, rope_theta=150000.0, attention_bias=True,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
    ),
    # GLM-5-like: MoE FFN plus a DeepSeek-style sparse indexer shared by groups of 4 layers.
    "glm-dsa": ModelConfig(
        arch="dsa", vocab_size=32000, hidden_size=1536, num_layers=24, num_heads=12, num_kv_heads=4,
        head_dim=128, intermediate_size=4096, num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=512, index_n_heads=4, index_head_dim=64, index_topk=256, index_share=4,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Return the preset called ``name``.

    Raises:
        ValueError: ``name`` is not a preset; the message lists the known ones.

    Example:
        >>> get_preset("tiny-moe").num_experts
        8
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None
