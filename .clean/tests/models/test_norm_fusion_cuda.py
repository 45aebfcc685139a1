"""BCG_NORM_FUSION (and BCG_INPUT_NORM_FUSION) on CUDA in bf16: a dense model's breakable graphs replay exactly what the
folded layers run eagerly, their logits stay within bf16 rounding of the unfolded model's, and each layer runs one
norm kernel fewer (up to 16 rows with the input fold, none). Run with
``python -m pytest -m cuda tests/models/test_norm_fusion_cuda.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_cache import random_prompts

from bcg import env
from bcg.models import get_preset
from bcg.models.dense import folds_input_norm, folds_post_attention_norm
from bcg.runtime import Engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
OPTS = dict(buckets=[16, 32, 64], chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16", device="cuda", seed=0,
            kernels="fused", progress=False)
CONFIGS = {  # a small dense model, and llama-dense's layer shape (hidden 1024, intermediate 2816) on fewer layers
    "small": replace(get_preset("tiny-dense"), hidden_size=256, head_dim=64, intermediate_size=512),
    "llama": replace(get_preset("llama-dense"), num_layers=4),
}
LENGTHS = ([3, 7, 12, 1], [40, 9], [64], [150])  # the 16-, 64- and 64-row buckets, and chunks past them


@pytest.mark.parametrize("input_fold", [False, True])  # True: BCG_INPUT_NORM_FUSION as well
@pytest.mark.parametrize("name", CONFIGS)
def test_replay_equals_eager_and_the_unfolded_model_within_bf16(name, input_fold, monkeypatch):
    monkeypatch.setattr(env, "NORM_FUSION", True)
    monkeypatch.setattr(env, "INPUT_NORM_FUSION", input_fold)
    # Islands at every bucket (the engine's default on CUDA adds whole-step graphs, whose attention differs), and each
    # bucket replayed against eager at its padded shape: the same kernels, so the same bits.
    eng = Engine(CONFIGS[name], backend="breakable", verify=True, full_graph_tokens=0, **OPTS)
    assert eng.telemetry.refused_reason is None and all(folds_post_attention_norm(la) for la in eng.model.layers)
    assert all(folds_input_norm(la) == input_fold for la in eng.model.layers)
    assert eng.telemetry.num_captured == 3
    assert all(r.verify_diff == 0.0 for r in eng.telemetry.buckets.values()), eng.telemetry.buckets
    folded = [eng.prefill(random_prompts(lengths, seed=3)) for lengths in LENGTHS]
    monkeypatch.setattr(env, "NORM_FUSION", False)
    plain = Engine(CONFIGS[name], backend="breakable", full_graph_tokens=0, **OPTS)
    for lengths, res in zip(LENGTHS, folded):
        ref = plain.prefill(random_prompts(lengths, seed=3))
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 8)
        tol = 2e-2 * max(1.0, ref.logits.abs().max().item())
        assert (res.logits - ref.logits).abs().max().item() <= tol
        top2 = ref.logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert torch.equal(res.next_tokens[clear], ref.next_tokens[clear])


def _kernel_counts(eng: Engine, prompt: list[int]) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.prefill([prompt])
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def test_each_layer_runs_one_norm_kernel_fewer(monkeypatch):
    config, prompt = CONFIGS["llama"], random_prompts([40], seed=5)[0]
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(env, "NORM_FUSION", on)
        counts[on] = _kernel_counts(Engine(config, backend="eager", **OPTS), prompt)
    layers = config.num_layers
    # Off: each layer's input and post-attention norms, and the final one; on: the post-attention norm is gone.
    assert counts[False]["_rms_norm_kernel"] == 2 * layers + 1, counts[False]
    assert counts[True]["_rms_norm_kernel"] == layers + 1, counts[True]
    assert counts[True]["_gate_up_silu_kernel"] == counts[False]["_gate_up_silu_kernel"] == layers


def test_up_to_16_rows_the_input_norm_rides_the_qkv_kernel_too(monkeypatch):
    config, prompt = CONFIGS["llama"], random_prompts([12], seed=5)[0]
    monkeypatch.setattr(env, "NORM_FUSION", True)
    monkeypatch.setattr(env, "INPUT_NORM_FUSION", True)
    counts = _kernel_counts(Engine(config, backend="eager", **OPTS), prompt)
    layers = config.num_layers
    # Only the final norm is a kernel of its own: each layer's input add + norm is in its q/k/v kernel, the
    # post-attention one in its gate/up kernel.
    assert counts.get("_rms_norm_kernel", 0) == 1, counts
    assert counts["_qkv_rope_kernel"] == counts["_gate_up_silu_kernel"] == layers, counts
