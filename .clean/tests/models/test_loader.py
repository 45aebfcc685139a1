"""Loader: tiny transformers checkpoints load and reproduce the reference logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bcg.models.loader import CheckpointError, config_from_hf, load_checkpoint

transformers = pytest.importorskip("transformers")

TINY = dict(
    num_hidden_layers=2, hidden_size=64, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "llama-bias-tied": lambda: transformers.LlamaConfig(**TINY, attention_bias=True, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**TINY, **MOE),
    "qwen3_moe-norm-topk": lambda: transformers.Qwen3MoeConfig(**TINY, **MOE, norm_topk_prob=True),
}


def _save(tmp_path, hf_config, **save_kwargs):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # non-zero biases and norm scales so their wiring is tested
        for param in hf_model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    hf_model.save_pretrained(tmp_path, **save_kwargs)
    return hf_model


def _our_last_logits(model, input_ids: torch.Tensor, prefill) -> torch.Tensor:
    from bcg.ops.kv_cache import KVPool

    pool = KVPool.for_model(model.config, 64, "cpu", torch.float32)
    return prefill(model, pool, [(None, input_ids.tolist())]).logits[0]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path, prefill):
    hf_model = _save(tmp_path, CASES[case]())
    model = load_checkpoint(tmp_path, "cpu", torch.float32)
    input_ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0, -1].float()
    assert (_our_last_logits(model, input_ids, prefill) - expected).abs().max() <= 1e-4


def test_sharded_checkpoint(tmp_path, prefill):
    hf_model = _save(tmp_path, CASES["qwen3"](), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_checkpoint(tmp_path, "cpu", torch.float32)
    input_ids = torch.arange(1, 9)
    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0, -1]
    assert (_our_last_logits(model, input_ids, prefill) - expected).abs().max() <= 1e-4


def test_config_mapping():
    config = config_from_hf(CASES["qwen3_moe"]().to_dict())
    assert (config.arch, config.qk_norm, config.num_experts, config.moe_intermediate_size) == ("moe", True, 8, 32)
    assert config.num_kv_heads == 2 and config.head_dim == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_config_is_rejected(change, message):
    hf_config = {**CASES["llama"]().to_dict(), **change}
    hf_config = {key: value for key, value in hf_config.items() if value is not None}
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(hf_config)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    _save(tmp_path, CASES["llama"]())
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.self_attn\.k_proj\.weight.*unexpected: "
                       r"model\.layers\.0\.mlp\.extra\.weight"):
        load_checkpoint(tmp_path, "cpu", torch.float32)


def test_no_config_or_weights(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path, "cpu", torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(CASES["llama"]().to_dict()))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path, "cpu", torch.float32)
