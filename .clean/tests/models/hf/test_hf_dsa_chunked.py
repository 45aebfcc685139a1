"""DSA models (deepseek_v32, glm_moe_dsa) prefilled in chunks, against transformers' own forward in the same chunks
(its cache) and in one shot. Where the indexer's scores tie at the top-k boundary (few index heads), which keys win
depends on the shape of the computation: transformers' chunked forward then differs from its own one-shot forward,
and bcg's chunked prefill follows transformers' chunked forward. Where nothing ties (8 index heads), all three agree."""

from __future__ import annotations

import inspect

import pytest
import torch
from engine_cache import max_diff
from hf_cases import make_model, one_thread, prompts, reference_copy

from bcg.runtime import Engine

CHUNK = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@torch.no_grad()
def _transformers(ref, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-token logits of transformers' own forward: in one shot, and in chunks of CHUNK through its cache."""
    from transformers import DynamicCache

    one_shot = ref(input_ids=prompt[None], use_cache=False).logits[0, -1]
    cache = DynamicCache(config=ref.config)
    name = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"  # 5.24 / 5.17
    for start in range(0, len(prompt), CHUNK):
        ids = prompt[None, start : start + CHUNK]
        out = ref(input_ids=ids, use_cache=True, position_ids=torch.arange(start, start + ids.shape[1])[None],
                  **{name: cache})
    return one_shot, out.logits[0, -1]


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("index_heads", [2, 8])
def test_chunked_prefill_matches_transformers_chunked_forward(arch, index_heads):
    model = make_model(arch, index_n_heads=index_heads)
    prompt = prompts([40])[0]
    one_shot, chunked = _transformers(reference_copy(model), prompt)
    eng = Engine(model, backend="breakable", device="cpu", buckets=[16, 32], chunked_prefill_size=CHUNK,
                 kv_tokens=256, progress=False)
    ours = eng.prefill([prompt])
    assert [b.num_tokens for b in ours.batches] == [32, 8]
    assert max_diff(ours.logits[0], chunked) <= 1e-4
    if index_heads == 8:  # no ties: chunks do not change the picks
        assert max_diff(ours.logits[0], one_shot) <= 1e-4
    else:  # ties at the top-k boundary: transformers' own chunked forward differs from its one-shot one too
        assert max_diff(chunked, one_shot) > 1e-2
