"""KV slots over a prefill's life: all or nothing on every exit path, freed as prompts finish, pool sized for the
model's context length."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_cache import EngineCache, random_prompts

from bcg.models import get_preset
from bcg.runtime import Engine

engine = EngineCache(buckets=[8, 16, 32], chunked_prefill_size=32, kv_tokens=256, device="cpu")


class Injected(Exception):
    pass


class _NoMemoryLogits(torch.Tensor):
    """Logits whose copy out of the forward's buffers runs out of memory."""

    def clone(self, *args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (injected) copying the logits out")


def _fail_logits_alloc(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> None:
    real = eng.runner.forward
    calls = {"n": 0}

    def forward(batch):
        out = real(batch)
        calls["n"] += 1
        if calls["n"] == 2:  # a later forward: an earlier prompt's slots went back to the reservation meanwhile
            out.logits = out.logits.as_subclass(_NoMemoryLogits)
        return out

    monkeypatch.setattr(eng.runner, "forward", forward)


def _interrupt_runner(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> None:
    calls = {"n": 0}
    real = eng.runner.forward

    def forward(batch):
        calls["n"] += 1
        if calls["n"] == 2:  # the second forward: the first chunk's slots are in use
            raise KeyboardInterrupt
        return real(batch)

    monkeypatch.setattr(eng.runner, "forward", forward)


def _fail_logits(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> None:
    import bcg.runtime.prefill as prefill_module

    def finished(plan, logits):  # the LM head runs in the graph: fail where its logits are read out
        raise Injected("reading the logits out failed")

    monkeypatch.setattr(prefill_module, "finished_logits", finished)


def _fail_batch(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> None:
    from bcg.runtime.batch import PrefillBatch

    calls = {"n": 0}
    real = PrefillBatch.from_arrays

    def from_arrays(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # packing the third forward: chunks hold lent slots, and some went back to the pool
            raise Injected("batch packing failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(PrefillBatch, "from_arrays", from_arrays)


INJECTIONS = {"logits_alloc": (_fail_logits_alloc, torch.OutOfMemoryError),
              "keyboard_interrupt": (_interrupt_runner, KeyboardInterrupt),
              "logits": (_fail_logits, Injected), "batch": (_fail_batch, Injected)}


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("where", INJECTIONS)
def test_a_failure_anywhere_in_a_prefill_returns_every_slot(where: str, device: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On real CUDA graphs too (bf16 there), where a graph replay is in flight when the failure lands."""
    opts = dict(buckets=[8, 16, 32], chunked_prefill_size=32, kv_tokens=128, progress=False, device=device,
                dtype="float32" if device == "cpu" else "bfloat16")
    eng = Engine("tiny-dense", backend="breakable", **opts)
    inject, error = INJECTIONS[where]
    batch = random_prompts([50, 20, 30])  # several forwards, so a failure can land between them
    expected = Engine("tiny-dense", backend="eager", **opts).prefill(batch).logits
    with monkeypatch.context() as m:
        inject(m, eng)
        with pytest.raises(error):
            eng.prefill(batch)
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
    tol = 1e-5 if device == "cpu" else 2e-2 * max(1.0, expected.abs().max().item())
    assert (eng.prefill(batch).logits - expected).abs().max().item() <= tol  # the pool is whole again


def test_a_lowered_chunk_size_still_prefills_long_prompts_with_the_default_pool() -> None:
    eng = Engine("tiny-dense", backend="breakable", device="cpu", chunked_prefill_size=16, progress=False)
    prompt = random_prompts([100])
    ref = engine("tiny-dense", "eager").prefill(prompt)
    res = eng.prefill(prompt)
    assert len(res.batches) == 7 and all(b.graph_used for b in res.batches)
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5


def test_the_default_pool_prefills_a_prompt_as_long_as_the_context_length() -> None:
    config = replace(get_preset("tiny-dense"), max_position_embeddings=12288)
    eng = Engine(config, backend="eager", device="cpu", progress=False)  # default chunk 2048, default pool
    prompt = random_prompts([12288], seed=4)
    res = eng.prefill(prompt)
    assert len(res.batches) == 6 and eng.kv_pool.num_free == eng.kv_pool.num_slots
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.prefill(random_prompts([12289]))


def test_long_prompts_near_the_context_length_match_eager_through_graphs() -> None:
    config = replace(get_preset("tiny-dense"), max_position_embeddings=160)
    eng = Engine(config, backend="breakable", device="cpu", chunked_prefill_size=24, progress=False)
    ref = Engine(config, backend="eager", device="cpu", chunked_prefill_size=160, progress=False)
    batch = random_prompts([160, 7, 150, 1, 159], seed=5)
    res, expected = eng.prefill(batch), ref.prefill(batch)
    assert (res.logits - expected.logits).abs().max().item() <= 1e-5
    assert torch.equal(res.next_tokens, expected.next_tokens)
    assert sum(b.graph_used for b in res.batches) >= len(res.batches) - 1
    assert eng.kv_pool.num_slots < sum(len(p) for p in batch)  # the call needed more slots than the pool holds


def test_slots_of_finished_prompts_are_reused_within_one_prefill() -> None:
    eng = Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8, 16, 32], chunked_prefill_size=32,
                 kv_tokens=100, progress=False)
    peak = {"held": 0}
    real = eng.runner.forward

    def forward(batch):
        peak["held"] = max(peak["held"], eng.kv_pool.num_slots - eng.kv_pool.num_free)
        return real(batch)

    eng.runner.forward = forward
    batch = random_prompts([90, 30, 30, 30, 30], seed=6)  # 210 tokens through a 100-slot pool
    res = eng.prefill(batch)
    ref = engine("tiny-dense", "eager").prefill(batch)
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5
    assert peak["held"] <= 90 + 32  # the long prompt plus at most one chunk of others
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots


def test_prompts_that_cannot_fit_at_once_fail_before_anything_runs() -> None:
    eng = engine("tiny-dense", "breakable")
    k0 = eng.kv_pool.k[0].clone()
    with pytest.raises(ValueError, match="KV slots.*kv_tokens"):
        eng.prefill(random_prompts([300]))  # one prompt longer than the 256-slot pool
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots and torch.equal(eng.kv_pool.k[0], k0)
