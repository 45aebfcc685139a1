"""Static buffers scale sanely: the logits exist once per engine (shared by every bucket, sized for the largest), and
static buffers larger than the free memory are refused in one line before anything is allocated."""

from __future__ import annotations

import gc

import pytest
import torch

import bcg.runtime.runner.inputs as inputs_module
from bcg.models.config import ModelConfig
from bcg.ops.attention import SdpaAttention
from bcg.ops.kv_cache import KVPool
from bcg.runtime import Engine
from bcg.runtime.runner.inputs import StaticInputs
from bcg.runtime.runner.runner import Runner

VOCAB = 2**22  # 16 MiB a row of fp32 logits


def _vocab_wide_storages(vocab: int, model: torch.nn.Module) -> dict[int, int]:
    """Every live tensor storage holding rows of ``vocab`` logits (a last dimension of ``vocab``): data_ptr -> bytes.
    The model's weights (and the head's transposed view of its weight) are not counted."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found = {}
    for obj in gc.get_objects():
        is_tensor = issubclass(type(obj), torch.Tensor)  # type(), not isinstance: no object's __class__ is read
        if is_tensor and obj.dim() == 2 and obj.shape[-1] == vocab and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in weights:
                found[storage.data_ptr()] = storage.nbytes()
    return found


def test_a_large_vocabulary_holds_one_logits_buffer_for_every_bucket() -> None:
    mc = ModelConfig(arch="dense", vocab_size=VOCAB, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8, intermediate_size=8)
    eng = Engine(mc, device="cpu", chunked_prefill_size=64, kv_tokens=64, max_logit_rows=4, warmup=0,
                 progress=False, prefix_cache=False)
    assert eng.telemetry.num_captured == len(eng.config.buckets) == 10
    gc.collect()
    static = eng.runner.inputs.static_logits
    assert static.shape == (4, VOCAB)
    # Before: each of the 10 graphs kept the head's own (rows, vocab) output, 10 more buffers of up to 64 MiB.
    assert _vocab_wide_storages(VOCAB, eng.model) == {static.untyped_storage().data_ptr(): 4 * VOCAB * 4}
    # ... and the graphs still compute the logits: a replay equals the eager engine.
    ref = Engine(mc, backend="eager", device="cpu", kv_tokens=64, progress=False, prefix_cache=False)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    res = eng.prefill(prompts)
    assert res.batches[0].graph_used
    torch.testing.assert_close(res.logits, ref.prefill(prompts).logits, rtol=1e-5, atol=1e-5)


def test_static_buffers_larger_than_free_memory_are_refused_before_allocating(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    pool = KVPool(64, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    attention = SdpaAttention(pool)
    allocated: list[tuple] = []
    real_zeros = torch.zeros

    def zeros(*size, **kw):
        allocated.append(size)
        return real_zeros(*size, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    # 2**40 tokens of vocabulary: 64 rows of fp32 logits are 256 TiB, more than any machine has free.
    with pytest.raises(ValueError) as e:
        StaticInputs(attention, attention, pool, [16, 64], 8, 2**40, 64, torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert "\n" not in message and "static buffers need" in message
    assert "logits 64 rows x 1099511627776 vocab" in message and "lower max_logit_rows (now 64)" in message
    assert allocated == []  # refused from the estimate, nothing allocated


def test_the_engine_refuses_static_buffers_the_free_memory_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs_module, "available_bytes", lambda device: 1 << 20)  # 1 MiB free
    with pytest.raises(ValueError, match=r"static buffers need .* GiB and the cpu has 0\.0 GiB free.*max_tokens"):
        Engine("tiny-dense", device="cpu", buckets=[8, 4096], kv_tokens=4096, max_logit_rows=4096,
               progress=False)
    # What fits is built: the check measures, it does not refuse by default.
    monkeypatch.setattr(inputs_module, "available_bytes", lambda device: 1 << 30)
    assert isinstance(Engine("tiny-dense", device="cpu", buckets=[8], progress=False).runner, Runner)
