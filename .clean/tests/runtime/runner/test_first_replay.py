"""Every captured bucket is replayed once at build, on the dummy batch: a CUDA graph's first launch uploads it (a
~190 ms time-to-first-token tail under load on an H200 when the first served request paid it), and a bucket whose
first replay fails is disabled with the reason rather than failing the first request that reaches it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_cache import random_prompts

from bcg.runtime import Engine
from bcg.runtime.backends.breakable import BreakableBackend

OPTS = dict(backend="breakable", device="cpu", buckets=[8, 16, 32], chunked_prefill_size=32, kv_tokens=256,
            progress=False)


def test_every_captured_bucket_is_replayed_once_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    replays: list[int] = []
    real = BreakableBackend.replay

    def replay(self: Any, handle: Any, num_tokens: int) -> None:
        replays.append(num_tokens)
        return real(self, handle, num_tokens)

    monkeypatch.setattr(BreakableBackend, "replay", replay)
    eng = Engine("tiny-dense", **OPTS)
    assert sorted(replays) == [8, 16, 32]  # once each, before any request
    batch = random_prompts([5, 9])
    want = Engine("tiny-dense", **{**OPTS, "backend": "eager"}).prefill(batch)
    assert torch.allclose(eng.prefill(batch).logits, want.logits, atol=1e-5)  # the dummy replay left nothing behind


def test_a_bucket_whose_first_replay_fails_is_disabled_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    real = BreakableBackend.replay
    building = {"on": True}

    def replay(self: Any, handle: Any, num_tokens: int) -> None:
        if building["on"] and num_tokens == 16:
            raise RuntimeError("replay failed (injected)")
        return real(self, handle, num_tokens)

    monkeypatch.setattr(BreakableBackend, "replay", replay)
    eng = Engine("tiny-dense", **OPTS)
    building["on"] = False
    reason = eng.runner.table.buckets[16].record.disabled_reason
    assert reason is not None and reason.startswith("first replay failed") and "injected" in reason
    assert eng.runner.table.buckets[8].record.disabled_reason is None
    res = eng.prefill(random_prompts([12]))  # 12 tokens would pad to 16: served by the next bucket up or eagerly
    assert res.batches[0].bucket != 16
