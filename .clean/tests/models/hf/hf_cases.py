"""Tiny random transformers models of every architecture the transformers path is tested on, and their references.

Each config turns on what makes its architecture different: sliding windows (mistral), q/k/v biases (qwen2), partial
rotary in a fused qkv projection (phi3), q/k norms per head (qwen3) or over the whole projection with norms after
each sublayer (olmo2), residual, attention and embedding multipliers and a logit scale (granite), gemma3's (1 + w)
q/k norms and per-layer-type RoPE, experts (qwen3_moe, glm4_moe, gpt_oss, mixtral),
partial rotary and shared experts with a routing bias (glm4_moe), sinks, alternating sliding windows and yarn RoPE
(gpt_oss), MLA with a sparse indexer and cross-layer top-k sharing (glm_moe_dsa, deepseek_v32; 8 index heads so the
indexer's top-k has no ties), and gemma2, which bcg's native path does not know: logit soft-capping in attention and
at the LM head, sliding windows, a custom attention scale and an input scale.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text", "olmo2", "granite",
         "gpt_oss", "glm4_moe", "mixtral", "glm_moe_dsa", "deepseek_v32"]
MOE_ARCHS = ("qwen3_moe", "glm4_moe", "gpt_oss", "mixtral", "glm_moe_dsa", "deepseek_v32")
VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
DSA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, index_topk=4,
           index_head_dim=16, index_n_heads=8, n_group=1, topk_group=1, first_k_dense_replace=1, n_routed_experts=8,
           num_hidden_layers=3, num_key_value_heads=4)
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 8, "rope_theta": 150000.0}
# Prompts of a packed batch and a chunked one: with chunked_prefill_size 32 the engine runs 3 + 13 + the first 16 of
# the 40 in one forward, then the last 24 of the 40 (reading its 16 from the pool, longer than any window) + 7.
LENGTHS = [3, 13, 40, 7]


def make_config(arch: str, **overrides: Any) -> Any:
    T = transformers
    if arch == "llama":
        cfg = T.LlamaConfig(**COMMON)
    elif arch == "mistral":
        cfg = T.MistralConfig(**COMMON, head_dim=16, sliding_window=8)
    elif arch == "qwen2":
        cfg = T.Qwen2Config(**COMMON)  # q/k/v biases
    elif arch == "phi3":
        cfg = T.Phi3Config(**COMMON, **TOKENS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                       "partial_rotary_factor": 0.5})
    elif arch == "gemma3_text":
        cfg = T.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=12,
                                 final_logit_softcapping=3.0)
    elif arch == "olmo2":
        cfg = T.Olmo2Config(**COMMON, **TOKENS)  # q/k norms over the whole projection, norms after each sublayer
    elif arch == "granite":
        cfg = T.GraniteConfig(**COMMON, residual_multiplier=0.5, attention_multiplier=0.3, embedding_multiplier=2.0,
                              logits_scaling=4.0)
    elif arch == "mixtral":
        cfg = T.MixtralConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    elif arch == "qwen3":
        cfg = T.Qwen3Config(**COMMON, head_dim=16)
    elif arch == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16, num_local_experts=8, norm_topk_prob=True)
    elif arch == "glm4_moe":
        cfg = T.Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 3}, **MOE, head_dim=16, n_routed_experts=8,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True)
    elif arch == "gpt_oss":
        cfg = T.GptOssConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, num_local_experts=8,
                             num_experts_per_tok=2, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=YARN)
    elif arch == "glm_moe_dsa":
        cfg = T.GlmMoeDsaConfig(**{**COMMON, **MOE, **DSA}, indexer_types=["full", "shared", "full"])
    elif arch == "deepseek_v32":
        cfg = T.DeepseekV32Config(**{**COMMON, **MOE, **DSA})
    elif arch == "gemma2":
        cfg = T.Gemma2Config(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=4,
                             attn_logit_softcapping=1.0, final_logit_softcapping=3.0, query_pre_attn_scalar=12)
    else:
        raise KeyError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A random model with weights spread enough that a wrong feature changes the logits (the default init keeps
    tiny models near-uniform)."""
    cfg = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08, generator=g)
            elif ("norm" in name or "layernorm" in name) and not arch.startswith("gemma"):
                p.normal_(1.0, 0.1, generator=g)
            else:
                p.normal_(0.0, 0.1, generator=g)  # biases, sinks, gemma's (1 + w) norms
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05, generator=g)
    return model.to(dtype).eval()


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy running transformers' own eager attention (made before bcg switches the original)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


@torch.no_grad()
def reference_logits(ref: torch.nn.Module, prompts: list[torch.Tensor]) -> torch.Tensor:
    """transformers' own forward on each prompt alone: last-token fp32 logits ``(len(prompts), vocab)``."""
    device = next(ref.parameters()).device
    return torch.stack([ref(input_ids=p[None].to(device), use_cache=False).logits[0, -1].float() for p in prompts])


def prompts(lengths: list[int] = LENGTHS, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


@functools.cache
def expected(arch: str) -> torch.Tensor:
    """transformers' own logits for :data:`LENGTHS` prompts (seed 3) of ``arch``'s seed-0 model, computed once."""
    return reference_logits(reference_copy(make_model(arch)), prompts())


def one_thread() -> Iterator[None]:
    """Body of a fixture: one torch thread (tiny models on a shared 2-core machine run ~50x slower on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
