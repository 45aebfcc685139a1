"""The CUDA tier of ``backend="full"`` with ``attention_backend="static_triton"``: real CUDA graphs in bf16 whose
attention is bcg's Triton kernel reading the KV pool through the read slots. Its logits match the default full
backend's (gather + FlashAttention varlen) and eager's, its greedy tokens too wherever the top-2 margin clears bf16's
tolerance, and a profiled replay has no gather of the keys and values: two gather kernels per layer fewer than the
default, and one attention kernel per layer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_cache import EngineCache, random_prompts

from bcg.models import get_preset

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = [16, 32, 64]
CONFIGS = {  # tiny presets with GPU-friendly attention shapes (head_dim 64 and 128)
    "tiny-dense": replace(get_preset("tiny-dense"), hidden_size=256, head_dim=64, intermediate_size=512),
    "tiny-moe": replace(get_preset("tiny-moe"), hidden_size=256, head_dim=128, intermediate_size=512,
                        moe_intermediate_size=64),
}
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16", device="cuda",
                     per_backend={"full": {"max_requests": 6, "prefix_capacity": 192}}, model_for=CONFIGS.get)
prompts = random_prompts
COMPOSITIONS = [[3, 7, 12, 1], [40, 9], [5, 4, 3, 2, 1, 6], [64], [150]]  # [150]: three chunks, with prefixes
GATHERS = ("indexselect", "gather", "index_elementwise")  # how torch's CUDA gather kernels are named


def assert_matches(res, ref, rel: float = 2e-2) -> None:
    """Logits within bf16 tolerance; the same greedy token wherever the reference's top-2 margin clears it."""
    tol = rel * max(1.0, ref.logits.abs().max().item())
    assert (res.logits - ref.logits).abs().max().item() <= tol
    top2 = ref.logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(res.next_tokens[clear], ref.next_tokens[clear])


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_matches_the_default_full_backend_and_eager_in_bf16(preset: str) -> None:
    eng = engine(preset, "full", attention_backend="static_triton")
    default, ref = engine(preset, "full"), engine(preset, "eager")
    assert eng.telemetry.attention_backend == "static_triton" and eng.telemetry.refused_reason is None
    assert eng.telemetry.num_captured == len(BUCKETS)
    for cache in (*eng.kv_pool.k, *eng.kv_pool.v):  # unused key slots name the scratch slot: NaN must not leak
        cache[eng.kv_pool.scratch_slot] = float("nan")
    for lengths in COMPOSITIONS:
        res = eng.prefill(prompts(lengths))
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 8), res.batches
        assert res.logits.isfinite().all()
        assert_matches(res, default.prefill(prompts(lengths)))
        assert_matches(res, ref.prefill(prompts(lengths)))


def _replay_kernels(eng, lengths: list[int]) -> list[str]:
    """The CUDA kernels of one prefill that replays a graph (after one unprofiled run)."""
    eng.prefill(prompts(lengths))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        res = eng.prefill(prompts(lengths))
        torch.cuda.synchronize()
    assert [b.graph_used for b in res.batches] == [True]
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_the_replay_attends_from_the_pool_without_gathers() -> None:
    eng, default = engine("tiny-dense", "full", attention_backend="static_triton"), engine("tiny-dense", "full")
    layers = eng.model.config.num_layers
    got, base = _replay_kernels(eng, [20, 9, 3]), _replay_kernels(default, [20, 9, 3])

    def gathers(names: list[str]) -> int:
        return sum(any(g in n.lower() for g in GATHERS) for n in names)

    assert sum("_varlen_fwd" in n for n in got) == layers, got  # one attention kernel per layer
    assert not any("flash" in n.lower() for n in got), got
    # The rest of the graph (embedding, KV writes, logit rows) is the same: exactly the K and V gathers are gone.
    assert gathers(base) - gathers(got) == 2 * layers, (base, got)
