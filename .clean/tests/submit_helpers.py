"""Shared by the CPU tests of Engine.submit (test_submit, test_submit_failures, test_submit_threads,
test_submit_refusals): one EngineCache for all of them, as when they were one module (a test that changes a shared
engine's state puts it back), eager references, and prompts opening with a shared head."""

from __future__ import annotations

import torch
from engine_cache import EngineCache, max_diff, random_prompts

from bcg.runtime import Engine

BUCKETS = [8, 16, 32, 64]
COMMON = dict(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, device="cpu")
engine = EngineCache(**COMMON, per_backend={"tc_piecewise": {"tc_compiler": "traced"},
                                            "full": {"max_requests": 8, "prefix_capacity": 192}})
TOL = 1e-5  # fp32 on the CPU


def reference(prompts: list[list[int]], preset: str = "tiny-dense") -> list:
    """Sequential eager prefills, one prompt each."""
    ref = engine(preset, "eager", prefix_cache=False)
    return [ref.prefill([p]) for p in prompts]


def same(res, ref) -> bool:
    """Logits within ``TOL`` of ``ref``'s and the same greedy tokens."""
    return max_diff(res.logits, ref.logits) <= TOL and torch.equal(res.next_tokens, ref.next_tokens)


def shared(num: int, head: int, tails: tuple[int, int] = (1, 40), seed: int = 0) -> list[list[int]]:
    """``num`` prompts opening with the same ``head`` tokens, then their own ``tails`` tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (head,), generator=g).tolist()
    lengths = torch.randint(tails[0], tails[1], (num,), generator=g).tolist()
    return [prefix + t for t in random_prompts(lengths, seed=seed + 1)]


def whole(eng: Engine) -> bool:
    """No slot leaked: once the cache is cleared every slot is free again."""
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()
    return eng.kv_pool.num_free == eng.kv_pool.num_slots
