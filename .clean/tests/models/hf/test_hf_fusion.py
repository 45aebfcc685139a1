"""Load-time fusion of transformers models: what is fused, what is left as written and why, no second copy of the
weights, the native path's GEMM count, exact RoPE variants, and restore() giving back the original modules."""

from __future__ import annotations

import pytest
import torch
from engine_cache import max_diff
from hf_cases import make_model, one_thread, prompts, reference_copy, reference_logits
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bcg.models.hf.patterns as patterns
from bcg.models.config import get_preset
from bcg.models.hf.fused_attention import rope_layout
from bcg.models.hf.fused_layer import FusedModule
from bcg.models.hf.model import HFCausalLM
from bcg.models.registry import build_model
from bcg.ops.kernels import qkv_norm_rope_reference
from bcg.runtime import Engine
from bcg.tensors import storage_key

SMALL = dict(device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.linear):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _matmuls_per_layer(model) -> float:
    """Matrix multiplies of one forward of the layer stack, per layer (the LM head is not in it)."""
    if isinstance(model, HFCausalLM):
        with model._one_request(8) as (ids, positions), _CountMatmuls() as mode:
            model.forward_layers(model.embed(ids), positions)
    else:
        eng = Engine(model, backend="eager", **{**SMALL, "buckets": [8], "chunked_prefill_size": 8})
        with _CountMatmuls() as mode:
            eng.prefill([list(range(8))])
        mode.count -= 1  # the LM head
    return mode.count / model.config.num_layers


def test_fused_llama_runs_the_native_paths_matmuls():
    """q/k/v and gate/up are one GEMM each: 4 per layer, as the native model, instead of 7 as written."""
    assert _matmuls_per_layer(HFCausalLM(make_model("llama"), fuse=False)) == 7
    assert _matmuls_per_layer(HFCausalLM(make_model("llama"))) == 4
    assert _matmuls_per_layer(build_model(get_preset("tiny-dense"))) == 4


@pytest.mark.parametrize(("arch", "fused", "left"), [
    ("llama", ["2 attention modules", "2 MLPs", "5 RMSNorms", "2 decoder layers"], []),
    ("granite", ["2 attention modules", "2 MLPs", "5 RMSNorms", "2 decoder layers"], []),  # residual multiplier
    ("olmo2", ["2 attention modules", "2 MLPs", "5 RMSNorms", "2 decoder layers"], []),  # post-norm layout
    ("gemma3_text", ["4 attention modules", "4 MLPs", "17 RMSNorms", "4 decoder layers"], []),
])
def test_notes_say_what_was_fused_and_what_was_left_as_written(arch, fused, left):
    eng = Engine(make_model(arch), backend="eager", **SMALL)
    first, *rest = eng.telemetry.notes
    assert first.startswith("fused at load: ") and all(f in first for f in fused), first
    assert rest == left


def test_dsa_models_run_as_written():
    """Their indexer's top-k could pick other keys after other roundings (in bf16 it did), so nothing is fused."""
    eng = Engine(make_model("deepseek_v32"), backend="eager", **SMALL)
    assert eng.telemetry.notes == ["not fused: the DSA indexer's top-k could pick other keys after the fused kernels' "
                                   "different roundings; every module runs as written"]
    assert not any(isinstance(m, FusedModule) for m in eng.model.hf.modules())


def test_weights_are_joined_not_copied():
    hf = make_model("qwen2")  # q/k/v biases too

    def stored_bytes() -> int:
        return sum({storage_key(p): p.untyped_storage().nbytes() for p in hf.parameters()}.values())

    before = stored_bytes()
    HFCausalLM(hf)
    attn = hf.model.layers[0].self_attn
    assert isinstance(attn, FusedModule)
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert storage_key(q.weight) == storage_key(k.weight) == storage_key(v.weight) == storage_key(attn.qkv_weight)
    assert storage_key(q.bias) == storage_key(attn.qkv_bias)
    assert stored_bytes() == before


def test_restore_puts_the_original_modules_and_weights_back():
    hf = make_model("glm4_moe")  # partial rotary: q and k rows are stored permuted while fused
    ref = reference_copy(hf)
    types = [type(m) for m in hf.modules()]
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    params = dict(hf.named_parameters())
    model = HFCausalLM(hf)
    assert isinstance(hf.model.layers[1].self_attn, FusedModule)
    assert list(hf.state_dict()) == list(state)  # the stand-ins register the originals' parameters by name
    model.restore()
    assert [type(m) for m in hf.modules()] == types and dict(hf.named_parameters()) == params
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in state.items())
    assert len({storage_key(p) for p in hf.parameters()}) == len(list(hf.parameters()))  # each its own storage
    hf.set_attn_implementation("eager")
    assert max_diff(reference_logits(hf, prompts()), reference_logits(ref, prompts())) == 0.0


class WeirdRMSNorm(nn.Module):
    """An RMSNorm-named module that scales by 0.5 + w: neither pattern bcg fuses."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, x.shape[-1:], None, self.eps) * (0.5 + self.weight)


def test_a_module_that_matches_no_pattern_is_left_as_written():
    hf = make_model("llama")
    hf.model.layers[0].input_layernorm = WeirdRMSNorm(64)
    want = reference_logits(reference_copy(hf), prompts())
    eng = Engine(hf, backend="breakable", **SMALL)
    assert eng.telemetry.notes[1:] == [
        "left as written: WeirdRMSNorm (1 module): it is not w * x / rms(x) nor (1 + w) * x / rms(x)",
        "left as written: LlamaDecoderLayer (1 module): its input_layernorm is not an RMSNorm bcg fused"]
    assert isinstance(hf.model.layers[1], FusedModule) and not isinstance(hf.model.layers[0], FusedModule)
    assert max_diff(eng.prefill(prompts()).logits, want) <= 1e-4


def test_a_stand_in_that_differs_from_its_module_is_not_kept(monkeypatch):
    real = patterns.rope_layout
    monkeypatch.setattr(patterns, "rope_layout", lambda f, d, s: real(f * 1.01, d, s))  # a wrong rotary table
    hf = make_model("qwen3")
    want = reference_logits(reference_copy(hf), prompts())
    eng = Engine(hf, backend="eager", **SMALL)
    assert any(n.startswith("left as written: Qwen3Attention (2 modules): its fused form differs from the module as "
                            "written by up to ") for n in eng.telemetry.notes), eng.telemetry.notes
    assert not any(isinstance(m.self_attn, FusedModule) for m in hf.model.layers)
    assert max_diff(eng.prefill(prompts()).logits, want) <= 1e-4


def test_partial_rotary_layout_rotates_as_transformers():
    """q and k stored permuted and rotated over the whole head by zero-padded frequencies are transformers' partial
    rotary, permuted: the same dot products."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    heads, dim, rot = 2, 16, 8
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    positions = torch.arange(5) * 7
    q, k = torch.randn(5, heads, dim, generator=g), torch.randn(5, heads, dim, generator=g)
    freqs = positions[:, None].float() * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1)[None].cos(), torch.cat((freqs, freqs), -1)[None].sin()
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    layout = rope_layout(inv_freq, dim, 1.0)
    qkv = torch.cat([q[..., layout.rows], k[..., layout.rows], torch.zeros(5, heads, dim)], 1).flatten(1)
    outs = (torch.empty(5, heads, dim), torch.empty(5, heads, dim), torch.empty(5, heads, dim))
    qkv_norm_rope_reference(qkv, positions, layout.inv_freq, None, None, 1e-6, *outs)
    back = torch.argsort(layout.rows)
    assert torch.allclose(outs[0][..., back], want_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(outs[1][..., back], want_k[0].transpose(0, 1), atol=1e-6)


def test_fusion_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("BCG_HF_FUSION", "off")
    eng = Engine(make_model("llama"), backend="eager", **SMALL)
    assert eng.telemetry.notes == [] and not any(isinstance(m, FusedModule) for m in eng.model.hf.modules())


def test_a_layer_whose_residual_scale_is_dropped_is_refused(monkeypatch):
    """Negative control for the scaled-residual layout: a stand-in that ignores granite's residual_multiplier differs
    from the layer as written, so the layers are left as written and the logits stay transformers'."""
    from bcg.models.hf.fused_layer import FusedDecoderLayer

    real = FusedDecoderLayer.__init__
    monkeypatch.setattr(FusedDecoderLayer, "__init__", lambda self, o, k, n, s=1.0: real(self, o, k, n, 1.0))
    hf = make_model("granite")
    want = reference_logits(reference_copy(hf), prompts())
    eng = Engine(hf, backend="eager", **SMALL)
    assert any(n.startswith("left as written: GraniteDecoderLayer (2 modules): its fused form differs")
               for n in eng.telemetry.notes), eng.telemetry.notes
    assert max_diff(eng.prefill(prompts()).logits, want) <= 1e-4


def test_a_layers_last_add_runs_with_the_next_modules_input_norm(monkeypatch):
    """Chained pre-norm layers: every input norm but the first layer's, and the final norm, come out of the layer
    before's add (one fused add + RMSNorm); the logits stay transformers' own, eager and in graphs."""
    from bcg.models.hf.fused_layer import NormSpec

    model = make_model("llama", num_hidden_layers=3)
    want = reference_logits(reference_copy(model), prompts())
    engines = [Engine(model, backend=backend, **SMALL) for backend in ("eager", "breakable")]
    assert any("3 layer ends (the last residual add with the next module's input RMSNorm" in note
               for note in engines[0].telemetry.notes)
    first = model.model.layers[0].norms["input_layernorm"]
    normed = []
    real = NormSpec.__call__
    monkeypatch.setattr(NormSpec, "__call__", lambda spec, x, impl: normed.append(spec) or real(spec, x, impl))
    for eng in engines:
        normed.clear()
        res = eng.prefill(prompts())
        assert max_diff(res.logits, want) <= 1e-4 and torch.equal(res.next_tokens, want.argmax(-1))
        if eng.config.backend == "eager":  # a replay runs no Python: the capture decided
            assert normed == [first] * len(res.batches)
