"""Writes a Hugging Face checkpoint with random weights in the shape of a real model, saved by transformers.

The GPU machine has no internet, so benchmarks that load "a Qwen3-0.6B-shaped checkpoint by path" make one here:
transformers builds the model from its own config class, initialises it with its own init, and saves config.json and
safetensors exactly as a downloaded checkpoint would look.

Usage: python scripts/make_checkpoint.py SHAPE OUTDIR   (SHAPE: one of SHAPES' keys)

The MoE shapes are large in bf16 (qwen3-30b-a3b 61 GB, gpt-oss-20b 42 GB of safetensors): write them where the
disk has room (the 2-GPU machine's 128 GB), or use their ``-8l`` variants (8 layers, the same widths).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SHAPES = {
    # Qwen3-0.6B: hidden 1024, 28 layers, 16 query / 8 KV heads of 128, q/k norm, tied embeddings.
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                                       rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 KV heads of 64, rope_theta 500000, tied embeddings (without
    # its llama3 RoPE scaling: other frequencies, the same work).
    "llama-3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                                         rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # gpt-oss-20b's layer shape (hidden 2880, 64/8 heads of 64, 32 experts top-4, sliding window every other
    # layer, attention sinks) with 12 layers instead of 24, so it fits a quick benchmark.
    "gpt-oss-small": ("GptOssConfig", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                           num_hidden_layers=12, num_attention_heads=64, num_key_value_heads=8,
                                           head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                           sliding_window=128, max_position_embeddings=131072)),
}
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 query / 4 KV heads of 128, q/k norm, 128 experts of 768, top-8,
# renormalised. gpt-oss-20b: hidden 2880, 24 layers, 64 / 8 heads of 64, 32 experts of 2880 top-4 with biases and
# clamped SwiGLU, sinks, a 128-token window every other layer, yarn RoPE (bf16 here; the release ships MXFP4 experts).
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096,
                                    "rope_theta": 150000.0})
SHAPES.update({
    "qwen3-30b-a3b": ("Qwen3MoeConfig", QWEN3_30B_A3B),
    "qwen3-30b-a3b-8l": ("Qwen3MoeConfig", {**QWEN3_30B_A3B, "num_hidden_layers": 8}),
    "gpt-oss-20b": ("GptOssConfig", GPT_OSS_20B),
    "gpt-oss-20b-8l": ("GptOssConfig", {**GPT_OSS_20B, "num_hidden_layers": 8}),
})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import transformers

    cls_name, fields = SHAPES[args.shape]
    config = getattr(transformers, cls_name)(**fields)
    torch.manual_seed(args.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e6:.0f}M parameters saved to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
