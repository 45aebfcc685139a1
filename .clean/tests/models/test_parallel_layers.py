"""Sharded layers: which slice each rank holds, the sizes that shard, and tensor parallel 2 checkpoint loading that
reads only each rank's slices and gives the single-process logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rank_pool import RankPool
from safetensors.torch import load_file, save_file

from bcg.models.config import ModelConfig, get_preset
from bcg.models.parallel_layers import Part, ShardSpec, check_tensor_parallel, shard_specs
from bcg.models.registry import build_model
from bcg.ops.parallel import TensorParallel, kv_head_range

transformers = pytest.importorskip("transformers")


def test_a_shard_spec_takes_each_parts_rows_and_pads_past_the_end():
    full = torch.arange(10.0)[:, None].expand(10, 2)
    spec = ShardSpec(0, (Part(6, 3, 6), Part(4, 2, 5)))  # rows 3-5 of part one, rows 2-3 of part two plus a pad
    assert spec.take(full)[:, 0].tolist() == [3.0, 4.0, 5.0, 8.0, 9.0, 0.0]
    assert spec.full_size == 10


@pytest.mark.parametrize(("kv_heads", "size"), [(4, 2), (4, 4), (2, 4), (1, 8)])
def test_kv_heads_are_split_or_replicated_so_each_rank_holds_those_its_query_heads_read(kv_heads, size):
    num_heads = 8
    for rank in range(size):
        tp = TensorParallel(size, rank)
        start, stop = kv_head_range(kv_heads, tp)
        q_start, q_stop = tp.shard(num_heads)
        group = num_heads // kv_heads
        assert {h // group for h in range(q_start, q_stop)} == set(range(start, stop))


@pytest.mark.parametrize(("change", "size", "message"), [
    ({"num_heads": 4}, 3, "does not divide num_heads=4"),
    ({"num_heads": 12, "num_kv_heads": 4, "intermediate_size": 192}, 6, "neither divides num_kv_heads=4"),
    ({"intermediate_size": 100}, 8, "intermediate_size=100"),
])
def test_sizes_that_cannot_shard_are_refused_by_name(change, size, message):
    fields = dict(arch="dense", vocab_size=256, hidden_size=64, num_layers=1, num_heads=8, num_kv_heads=2,
                  head_dim=8, intermediate_size=128)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(ModelConfig(**{**fields, **change}), size)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_each_rank_is_initialised_with_its_slice_of_the_one_process_weights(preset):
    config = get_preset(preset)
    if preset == "tiny-dense":  # a vocabulary that does not divide by the ranks, tied to the LM head
        config = ModelConfig(**{**config.__dict__, "vocab_size": 255, "tie_word_embeddings": True})
    full = dict(build_model(config, seed=3).named_parameters())
    for rank in range(2):
        model = build_model(config, seed=3, tp=TensorParallel(2, rank))
        specs = shard_specs(model)
        assert specs, "nothing is sharded"
        for name, param in model.named_parameters():
            expected = specs[name].take(full[name]) if name in specs else full[name]
            assert torch.equal(param, expected), name
        if config.tie_word_embeddings:
            assert model.lm_head.weight is model.embed_tokens.weight


# ---------------------------------------------------------------------------------------------------------------
# checkpoints at tensor parallel 2

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)
CHECKPOINTS = {
    # attention bias, tied embeddings and a vocabulary of 255: the last rank's slice ends in a padding row
    "llama": lambda: transformers.LlamaConfig(**TINY, vocab_size=255, attention_bias=True, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**TINY, vocab_size=256, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, norm_topk_prob=True),
}
CHECKPOINTS["qwen3_moe-fused"] = CHECKPOINTS["qwen3_moe"]  # experts stored stacked, gate and up fused
PROMPTS = [[5, 17, 200, 3, 9], [42, 1, 250, 77]]


def _save(folder: Path, case: str) -> None:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(CHECKPOINTS[case]()).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 1:  # non-zero biases and norm scales, so their slices matter
                param.add_(torch.randn_like(param) * 0.1)
    hf_model.save_pretrained(folder)
    if case.endswith("-fused"):  # the experts.gate_up_proj (E, 2I, H) / experts.down_proj (E, H, I) layout
        path = folder / "model.safetensors"
        tensors = load_file(path)
        for layer in range(TINY["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts."
            num = sum(1 for k in tensors if k.startswith(prefix) and k.endswith("down_proj.weight"))
            take = [{p: tensors.pop(f"{prefix}{e}.{p}_proj.weight") for p in ("gate", "up", "down")}
                    for e in range(num)]
            tensors[prefix + "gate_up_proj"] = torch.stack([torch.cat([t["gate"], t["up"]]) for t in take])
            tensors[prefix + "down_proj"] = torch.stack([t["down"] for t in take])
        save_file(tensors, path, metadata={"format": "pt"})


def _load_on_rank(folder: str) -> dict:
    import bcg.models.loader as loader
    from bcg.runtime import Engine

    whole: list[str] = []
    real = loader.safe_open

    class Recording:  # safe_open whose full reads are recorded (a sharded tensor must be read by slices)
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            whole.append(name)
            return self.inner.get_tensor(name)

    loader.safe_open = Recording
    try:
        eng = Engine(folder, backend="breakable", tp_size=2, device="cpu", buckets=[8, 16], progress=False)
    finally:
        loader.safe_open = real
    res = eng.prefill(PROMPTS)
    shapes = {n: tuple(p.shape) for n, p in eng.model.named_parameters()}
    return {"logits": res.logits.numpy(), "whole": whole, "shapes": shapes,
            "graph": [b.graph_used for b in res.batches]}


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_tp2_reads_only_its_slices_and_matches_the_one_process_logits(case, tmp_path):
    from bcg.runtime import Engine

    _save(tmp_path, case)
    ref = Engine(str(tmp_path), backend="eager", device="cpu", progress=False).prefill(PROMPTS).logits.numpy()
    ranks = RankPool(2, timeout_s=90)
    try:
        zero, one = ranks.run(_load_on_rank, str(tmp_path))
    finally:
        ranks.close()
    for res in (zero, one):
        assert np.abs(res["logits"] - ref).max() <= 1e-5
        assert res["graph"] == [True]
        # Read whole: only what every rank keeps entirely (norm scales, the MoE router, the row-parallel bias).
        assert all(n.endswith(("norm.weight", "mlp.gate.weight", "o_proj.bias")) for n in res["whole"]), res["whole"]
    assert zero["shapes"] == one["shapes"]
    assert zero["shapes"]["embed_tokens.weight"] == (128, 64)  # 255 rows over 2 ranks, padded to 2 x 128
    if case == "llama":
        assert zero["shapes"]["layers.0.self_attn.qkv.qkv_proj.bias"] == (64,)  # 2 q heads + 1 k + 1 v of 16
