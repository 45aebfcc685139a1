"""The transformers path refuses what it cannot honour, by name, before anything is captured; it loads by model_impl,
keeps a model's dtype, and gives the model back as it was."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from engine_cache import max_diff
from hf_cases import expected, make_model, one_thread, prompts, reference_copy, reference_logits

from bcg.models.base import CausalLM
from bcg.models.hf import UnsupportedModelError
from bcg.models.hf.attention import bcg_attention
from bcg.models.hf.model import HFCausalLM
from bcg.models.loader import CheckpointError
from bcg.runtime import Engine

SMALL = dict(device="cpu", buckets=[16], chunked_prefill_size=16, kv_tokens=64, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.mark.parametrize(("overrides", "named"), [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "RoPE type dynamic"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "RoPE type longrope"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layers of type linear_attention"),
    # bcg builds no masks: a sliding layer whose module passes no window would silently attend to everything.
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
     "layer 0 (LlamaAttention) is a sliding-window layer (window 4) but passes no sliding_window"),
])
def test_config_features_that_cannot_be_honoured_are_refused(overrides, named):
    model = make_model("llama")
    for k, v in overrides.items():
        setattr(model.config, k, v)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        HFCausalLM(model)


def test_attention_calls_that_cannot_be_honoured_are_refused():
    model = HFCausalLM(make_model("llama"))
    attn = model.body.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    with pytest.raises(UnsupportedModelError, match=r"passes attention kwarg alibi_slopes=Tensor\(4,\)"):
        bcg_attention(attn, q, kv, kv, None, scaling=0.25, alibi_slopes=torch.zeros(4))
    with pytest.raises(UnsupportedModelError, match="received an attention mask"):
        bcg_attention(attn, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(UnsupportedModelError, match="attention dropout 0.1"):
        bcg_attention(attn, q, kv, kv, None, dropout=0.1)
    with pytest.raises(UnsupportedModelError, match="not causal"):
        bcg_attention(attn, q, kv, kv, None, is_causal=False)
    with pytest.raises(UnsupportedModelError, match="attends 3 rows over 5 keys"):
        bcg_attention(attn, q, torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), None)


def test_a_tail_the_adapter_does_not_reproduce_is_refused():
    model = HFCausalLM(make_model("gemma2"))  # final_logit_softcapping reproduced: passes
    object.__setattr__(model, "tail", type(model.tail)())  # forget the soft-cap on purpose
    with pytest.raises(UnsupportedModelError, match="differ from the model's own forward"):
        model.check_tail()


def test_not_a_causal_lm_is_refused():
    import transformers

    base = transformers.AutoModel.from_config(make_model("llama").config)
    with pytest.raises(UnsupportedModelError, match="not a \\*ForCausalLM"):
        HFCausalLM(base)


def test_restore_gives_the_model_back_and_it_can_be_adapted_again():
    hf = make_model("glm_moe_dsa")
    hf.set_experts_implementation("eager")
    first = HFCausalLM(hf)
    assert hf.config._attn_implementation == "bcg" and first.auto_islands and first.dsa_islands
    second = HFCausalLM(hf)  # a second engine on the same model: islands are not stacked
    assert second.dsa_islands == first.dsa_islands and len(second.auto_islands) == len(first.auto_islands)
    assert second.previous_attn_implementation == "eager"
    second.restore()
    assert hf.config._attn_implementation == "eager"
    assert not any("forward" in vars(m) for m in hf.modules())


def test_pool_holds_what_each_layer_caches():
    shapes = [{n: tuple(t.shape[1:]) for n, t in b.items()}
              for b in HFCausalLM(make_model("gpt_oss")).make_kv_pool(8, "cpu", torch.float32).buffers]
    assert shapes == [{"k": (2, 16), "v": (2, 16)}] * 4
    dsa = HFCausalLM(make_model("deepseek_v32")).make_kv_pool(8, "cpu", torch.float32)
    # MLA: what transformers caches depends on its version (expanded K/V or the latents); the indexer keys too.
    assert [sorted(b) for b in dsa.buffers] == [["index", "k", "v"]] * 3
    assert dsa.buffers[0]["index"].shape == (9, 16)


def test_engine_keeps_the_models_dtype_and_device():
    eng = Engine(make_model("llama", dtype=torch.bfloat16), backend="eager", **{**SMALL, "device": None})
    assert (eng.dtype, eng.device.type, eng.config.dtype) == (torch.bfloat16, "cpu", "bfloat16")
    with pytest.raises(ValueError, match="the transformers model is in float32 but dtype='bfloat16' was asked"):
        Engine(make_model("llama"), dtype="bfloat16", **SMALL)


def test_model_impl_picks_the_implementation(tmp_path):
    qwen3, gemma2 = tmp_path / "qwen3", tmp_path / "gemma2"
    make_model("qwen3").save_pretrained(qwen3)
    make_model("gemma2").save_pretrained(gemma2)
    native, hf = Engine(qwen3, **SMALL), Engine(qwen3, model_impl="transformers", **SMALL)
    assert isinstance(native.model, CausalLM) and isinstance(hf.model, HFCausalLM)
    p = prompts([5, 9])
    assert torch.equal(native.prefill(p).next_tokens, hf.prefill(p).next_tokens)
    assert max_diff(native.prefill(p).logits, hf.prefill(p).logits) <= 1e-4
    auto = Engine(gemma2, **SMALL)  # not a native architecture: transformers
    assert isinstance(auto.model, HFCausalLM)
    assert max_diff(auto.prefill(prompts()).logits, expected("gemma2")) <= 1e-4
    with pytest.raises(CheckpointError, match="unsupported model_type 'gemma2'.*model_impl='transformers' runs"):
        Engine(gemma2, model_impl="native", **SMALL)
    with pytest.raises(ValueError, match="model_impl='native' needs a checkpoint folder"):
        Engine(make_model("llama"), model_impl="native", **SMALL)
    with pytest.raises(ValueError, match="model_impl='transformers' needs a checkpoint folder or a transformers"):
        Engine("tiny-dense", model_impl="transformers", **SMALL)
    with pytest.raises(ValueError, match="model_impl must be one of auto, native, transformers"):
        Engine("tiny-dense", model_impl="vllm", **SMALL)


def test_without_transformers(tmp_path):
    """bcg, its runtime and native models import and run without transformers; asking for it says how to get it."""
    make_model("gemma2").save_pretrained(tmp_path)
    code = f"""
import sys
sys.modules["transformers"] = None  # import transformers now raises ImportError
import bcg, bcg.runtime, bcg.models.hf
from bcg.runtime import Engine
eng = Engine("tiny-dense", device="cpu", buckets=[4], chunked_prefill_size=4, progress=False)
print(eng.prefill([[1, 2]]).next_tokens)
try:
    Engine({str(tmp_path)!r}, device="cpu", progress=False)
except ImportError as e:
    print("ImportError:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tensor([" in out.stdout
    assert "is not a model bcg implements natively (unsupported model_type 'gemma2'" in out.stdout
    assert "needs the transformers package, which is not installed: pip install" in out.stdout


def test_reference_is_transformers_own_forward():
    """The references really are transformers' forward (not bcg's): a second seed gives other logits."""
    other = reference_logits(reference_copy(make_model("llama", seed=1)), prompts())
    assert max_diff(other, expected("llama")) > 1e-2
