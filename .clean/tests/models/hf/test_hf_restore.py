"""A transformers model given back with restore(), two engines on one model object, and a model without weights:
every case is right or refused by name, never a silent wrong answer."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_cache import max_diff
from hf_cases import make_config, make_model, one_thread, prompts, reference_copy, reference_logits

from bcg.models.hf import UnsupportedModelError
from bcg.runtime import Engine

SMALL = dict(device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)
CHUNKED = [40, 7]  # the 40 runs as two chunks: its second reads the first's keys from the pool


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.mark.parametrize("backend", ["eager", "breakable"])
def test_a_restored_engine_refuses_to_prefill(backend):
    hf = make_model("llama")
    eng = Engine(hf, backend=backend, **SMALL)
    eng.prefill(prompts(CHUNKED))
    eng.model.restore()
    with pytest.raises(RuntimeError, match=r"given back with restore\(\).*Build a new Engine\(model\)"):
        eng.prefill(prompts(CHUNKED))
    again = Engine(hf, backend=backend, **SMALL)  # a new engine serves it again, right
    want = reference_logits(reference_copy(make_model("llama")), prompts(CHUNKED))
    assert max_diff(again.prefill(prompts(CHUNKED)).logits, want) <= 1e-4


def test_two_engines_on_one_model_both_stay_right_until_one_restores():
    hf = make_model("qwen3")
    want = reference_logits(reference_copy(hf), prompts(CHUNKED))
    first = Engine(hf, backend="breakable", **SMALL)
    second = Engine(hf, backend="eager", **SMALL)  # shares the first one's islands and fused modules
    assert second.model.state is first.model.state
    for eng in (first, second, first):
        assert max_diff(eng.prefill(prompts(CHUNKED)).logits, want) <= 1e-4
    second.model.restore()
    for eng in (first, second):
        with pytest.raises(RuntimeError, match="given back with restore"):
            eng.prefill(prompts([5]))


def test_a_second_engine_with_other_settings_is_refused_when_built():
    hf = make_model("qwen3")
    first = Engine(hf, backend="eager", kernels="torch", **SMALL)  # still serving the model
    with pytest.raises(ValueError, match="another engine on this Qwen3ForCausalLM runs its fused modules with "
                                         "kernels='torch'"):
        Engine(hf, backend="eager", kernels="fused", **SMALL)
    with pytest.raises(UnsupportedModelError, match="already serves another engine with auto_islands=True"):
        Engine(hf, backend="eager", auto_islands=False, **SMALL)
    assert first.prefill(prompts([5])).logits.shape == (1, 256)  # the first one is unharmed


def test_an_adaptation_no_engine_uses_any_more_gives_way():
    hf = make_model("qwen3")
    want = reference_logits(reference_copy(hf), prompts(CHUNKED))
    first = Engine(hf, backend="eager", kernels="torch", **SMALL)
    del first
    gc.collect()
    eng = Engine(hf, backend="eager", kernels="fused", auto_islands=False, **SMALL)  # other settings: adapted anew
    assert eng.config.kernels == "fused" and max_diff(eng.prefill(prompts(CHUNKED)).logits, want) <= 1e-4


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_model_without_weights_is_refused_naming_the_meta_device(device):
    import transformers

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(make_config("llama"))
    with pytest.raises(UnsupportedModelError, match="weights are on the meta device.*from_pretrained"):
        Engine(hf, backend="eager", **{**SMALL, "device": device})
