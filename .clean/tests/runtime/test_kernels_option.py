"""Engine(kernels=...): the fused-kernel path of every model equals the plain-torch path, and the option is checked."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_cache import EngineCache, max_diff, random_prompts

from bcg.models import get_preset
from bcg.runtime import Engine

CONFIGS = {name: get_preset(name) for name in ("tiny-dense", "tiny-moe", "tiny-dsa")}
CONFIGS["tiny-qknorm-bias"] = replace(get_preset("tiny-dense"), qk_norm=True, attention_bias=True)
engine = EngineCache(buckets=[8, 16, 32], chunked_prefill_size=32, kv_tokens=512, device="cpu",
                     model_for=CONFIGS.get)


@pytest.mark.parametrize("preset", CONFIGS)
@pytest.mark.parametrize("backend", ["eager", "breakable"])
def test_fused_path_equals_the_torch_path(preset: str, backend: str) -> None:
    # On a CPU "fused" runs the kernels' references: the same numbers as the plain ops, through the fused code path
    # of every module (residual stream, q/k/v written into the island's inputs, the MoE's permutation).
    fused, plain = engine(preset, backend, kernels="fused"), engine(preset, "eager", kernels="torch")
    assert fused.model.layers[0].mlp.kernels == "fused" and plain.model.layers[0].mlp.kernels == "torch"
    for lengths in ([3, 7, 12, 1], [20], [70]):
        batch = random_prompts(lengths, seed=len(lengths))
        res, ref = fused.prefill(batch), plain.prefill(batch)
        assert max_diff(res.logits, ref.logits) <= 1e-5 and torch.equal(res.next_tokens, ref.next_tokens)
        if backend == "breakable":
            assert all(b.graph_used for b in res.batches if b.num_tokens >= 4)


def test_default_is_torch_on_a_cpu_and_bad_values_are_rejected() -> None:
    assert Engine("tiny-dense", device="cpu", progress=False, buckets=[8]).model.layers[0].mlp.kernels == "torch"
    with pytest.raises(ValueError, match="kernels"):
        Engine("tiny-dense", device="cpu", kernels="triton")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("preset", "backend"), [
    *((p, b) for p in ("tiny-dense", "tiny-moe", "tiny-qknorm-bias") for b in ("breakable", "full")),
    ("tiny-dsa", "breakable"), ("tiny-moe", "tc_piecewise")])  # one Inductor compile: the fused ops stay opaque
def test_fused_kernels_on_cuda_match_torch_in_bf16(preset: str, backend: str) -> None:
    config = replace(CONFIGS[preset], hidden_size=256, head_dim=64, intermediate_size=512, moe_intermediate_size=64)
    kw = dict(buckets=[16, 32, 64], chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16", device="cuda", seed=0,
              progress=False, **({"max_requests": 6, "prefix_capacity": 192} if backend == "full" else {}))
    fused = Engine(config, backend=backend, kernels="fused", **kw)
    plain = Engine(config, backend="eager", kernels="torch", **kw)
    assert fused.model.layers[0].mlp.kernels == "fused" and fused.telemetry.num_captured == 3
    for lengths in ([3, 7, 12, 1], [40, 9], [64], [150]):
        batch = random_prompts(lengths, seed=3)
        res, ref = fused.prefill(batch), plain.prefill(batch)
        tol = 2e-2 * max(1.0, ref.logits.abs().max().item())
        assert (res.logits - ref.logits).abs().max().item() <= tol
        top2 = ref.logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert torch.equal(res.next_tokens[clear], ref.next_tokens[clear])
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 8)


@pytest.mark.parametrize("kernels", ["fused", "torch"])
def test_the_fused_rope_kernel_writes_the_kv_cache_itself(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.ops.attention import BatchContext

    eng, ref = engine("tiny-dense", "eager", kernels=kernels), engine("tiny-dense", "eager", kernels="torch")
    calls = []
    real = BatchContext.store_kv
    monkeypatch.setattr(BatchContext, "store_kv", lambda self, *a: calls.append(a[0]) or real(self, *a))
    batch = random_prompts([9, 30], seed=3)  # [30] then chunked: its second chunk reads the cached prefix
    res = eng.prefill(batch)
    assert calls == ([] if kernels == "fused" else list(range(CONFIGS["tiny-dense"].num_layers)) * len(res.batches))
    assert max_diff(res.logits, ref.prefill(batch).logits) <= 1e-5
