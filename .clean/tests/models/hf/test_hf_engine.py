"""Engine(transformers model): every architecture, fused at load, gives transformers' own logits and greedy tokens on a
packed batch and on chunked prefill, through breakable graphs (emulated) and eagerly; islands are named; backends that
cannot serve a model refuse it by name."""

from __future__ import annotations

import pytest
import torch
from engine_cache import EngineCache, max_diff
from hf_cases import ARCHS, expected, make_model, one_thread, prompts, reference_copy, reference_logits

from bcg.models.hf.fused_layer import FusedModule
from bcg.models.hf.model import HFCausalLM

TOL = 1e-4  # fp32 on the CPU
engines = EngineCache(model_for=make_model, device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def _check(res, want) -> None:
    assert max_diff(res.logits, want) <= TOL
    assert torch.equal(res.next_tokens, want.argmax(-1))
    # One packed forward of three prompts (the third's first chunk), then its second chunk (prefix from the pool)
    # packed with a fresh prompt.
    assert [(b.num_tokens, b.num_requests) for b in res.batches] == [(32, 3), (31, 2)]


@pytest.mark.parametrize("arch", ARCHS)
def test_breakable_matches_transformers(arch):
    eng = engines(arch, "breakable", verify=True)
    assert isinstance(eng.model, HFCausalLM) and eng.telemetry.refused_reason is None
    res = eng.prefill(prompts())
    _check(res, expected(arch))
    assert all(b.graph_used for b in res.batches)
    assert {n: r.verify_diff for n, r in eng.telemetry.buckets.items()} == {16: 0.0, 32: 0.0}
    assert eng.telemetry.auto_islands == []  # transformers' default experts are capturable


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_matches_transformers(arch):
    _check(engines(arch, "eager").prefill(prompts()), expected(arch))


def test_breaks_per_layer():
    # One break per attention layer; DSA models run each attention module as a module island.
    assert engines("llama", "breakable", verify=True).telemetry.buckets[32].num_breaks == 2
    dsa = engines("glm_moe_dsa", "breakable", verify=True)
    assert dsa.model.dsa_islands == ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"]
    assert dsa.telemetry.buckets[32].num_breaks == 3


@pytest.mark.parametrize("feature", ["s_aux", "sliding_window"])
def test_a_dropped_feature_changes_the_logits(feature, monkeypatch):
    """Negative control: the comparison above fails when gpt-oss's sinks or window are not honoured."""
    import bcg.models.hf.attention as hf_attention
    import bcg.models.hf.fused_attention as fused_attention

    real = hf_attention.attention

    def without(q, k, v, out, layer_id, scale, window, softcap, sinks, kv_stored=False):
        drop = {"s_aux": "sinks", "sliding_window": "window"}[feature]
        kwargs = {"scale": scale, "window": window, "softcap": softcap, "sinks": sinks, drop: None}
        real(q, k, v, out, layer_id, kv_stored=kv_stored, **kwargs)

    eng = engines("gpt_oss", "eager")
    monkeypatch.setattr(hf_attention, "attention", without)  # as written
    monkeypatch.setattr(fused_attention, "attention", without)  # fused at load
    res = eng.prefill(prompts())
    assert max_diff(res.logits, expected("gpt_oss")) > 1e-2


def test_uncapturable_experts_become_named_islands(monkeypatch):
    monkeypatch.setenv("BCG_HF_FUSION", "off")  # fused at load, the block runs bcg's kernels instead of the loop
    model = make_model("qwen3_moe")
    model.set_experts_implementation("eager")  # a loop over experts with nonzero and .item()
    ref = reference_copy(model)
    eng = EngineCache(device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256,
                      model_for=lambda _: model)("qwen3_moe-eager-experts", "breakable", verify=True)
    islands = eng.telemetry.auto_islands
    assert [s.split(" ")[0] for s in islands] == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert all("(Qwen3MoeExperts): aten.nonzero.default at qwen3_moe/modeling_qwen3_moe.py:" in s for s in islands)
    res = eng.prefill(prompts())
    _check(res, reference_logits(ref, prompts()))
    assert all(b.graph_used for b in res.batches)
    assert eng.telemetry.buckets[32].num_breaks == 4  # two attention islands and two experts islands


def test_without_auto_islands_capture_is_refused_naming_module_op_and_fix(monkeypatch):
    monkeypatch.setenv("BCG_HF_FUSION", "off")
    model = make_model("qwen3_moe")
    model.set_experts_implementation("eager")
    eng = EngineCache(device="cpu", buckets=[16], chunked_prefill_size=16, model_for=lambda _: model)(
        "qwen3_moe-strict", "breakable", auto_islands=False)
    reason = eng.telemetry.refused_reason
    assert "Qwen3MoeExperts (layers.0.mlp.experts, layers.1.mlp.experts) runs aten.nonzero.default" in reason
    assert "set_experts_implementation('grouped_mm')" in reason and "auto_islands=True" in reason
    assert eng.telemetry.auto_islands == []
    want = reference_logits(reference_copy(make_model("qwen3_moe")), prompts([5]))
    assert max_diff(eng.prefill(prompts([5])).logits, want) <= TOL  # served eagerly, still right


def test_full_backend_captures_plain_attention_whole():
    eng = engines("llama", "full", max_requests=4, verify=True)
    assert eng.telemetry.refused_reason is None
    res = eng.prefill(prompts())
    _check(res, expected("llama"))
    assert all(b.graph_used for b in res.batches)
    assert eng.telemetry.buckets[32].num_breaks == 0


@pytest.mark.parametrize(("arch", "named"), [("gpt_oss", "sliding window 4, attention sinks"),
                                             ("gemma2", "sliding window 4, logit soft-cap 1.0"),
                                             ("deepseek_v32", "the DSA attention module layers.0.self_attn")])
def test_full_backend_refuses_what_it_cannot_capture_by_name(arch, named):
    eng = engines(arch, "full", max_requests=4, buckets=[16], chunked_prefill_size=16)
    assert named in eng.telemetry.refused_reason and "backend='breakable'" in eng.telemetry.refused_reason
    served = eng.prefill(prompts([9]))  # eagerly, and right
    assert max_diff(served.logits, reference_logits(reference_copy(make_model(arch)), prompts([9]))) <= TOL


def test_tc_piecewise_and_compiled_breakable():
    compiled = engines("llama", "breakable", compile="traced")
    for eng in (engines("llama", "tc_piecewise", tc_compiler="traced"), compiled):
        assert eng.telemetry.refused_reason is None and eng.telemetry.compile_error is None
        res = eng.prefill(prompts())
        _check(res, expected("llama"))
        assert all(b.graph_used for b in res.batches)


def test_kernels_option_reaches_the_fused_modules():
    eng = engines("llama", "eager", kernels="fused")  # the references on a CPU: the same numbers
    assert {m.kernels for m in eng.model.hf.modules() if isinstance(m, FusedModule)} == {"fused"}
    _check(eng.prefill(prompts()), expected("llama"))
    # The fused RoPE writes each layer's K/V into the pool inside the graphs: the second chunk attends to them.
    _check(engines("llama", "breakable", kernels="fused").prefill(prompts()), expected("llama"))
    default = engines("llama", "eager")  # the default where Triton does not run: the plain torch ops
    assert {m.kernels for m in default.model.hf.modules() if isinstance(m, FusedModule)} == {"torch"}
