"""A transformers model served from the prefix cache: its per-layer buffers (MLA latents and an indexer's keys
included) live in the pool's slots like a native model's K/V, so a hit reads them through the same slots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_cache import EngineCache, max_diff

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models" / "hf"))  # the transformers tests' cases
from hf_cases import make_model, one_thread, prompts

engines = EngineCache(model_for=make_model, device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v32"])
def test_prefix_hits_of_a_transformers_model_equal_its_full_prefills(arch: str) -> None:
    eng = engines(arch, "breakable")
    head = prompts([40], seed=7)[0]
    tails = prompts([3, 11, 20], seed=8)
    served = [torch.cat([head, t]) for t in tails]
    results = [eng.submit(p).result(timeout=120) for p in served]
    assert [r.cached_tokens for r in results] == [0, 40, 40]
    full = eng.prefill(served)  # prefill() computes every prompt in full
    for i, res in enumerate(results):
        assert max_diff(res.logits, full.logits[i : i + 1]) <= 1e-4
        assert torch.equal(res.next_tokens, full.next_tokens[i : i + 1])
        assert all(b.graph_used for b in res.batches)
    eng.close()
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
