"""Compiled layer stacks (compile=): one trace, islands as breaks, the same numbers as eager, nothing at replay."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_cache import EngineCache, max_diff, random_prompts

from bcg.runtime import Engine

BUCKETS = [8, 16, 32]
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=32, kv_tokens=512, device="cpu",
                     per_backend={"full": {"max_requests": 4}})
prompts = random_prompts
COMPOSITIONS = [[3, 7, 12, 1], [20], [5, 6], [70]]  # [70] is chunked, with a cached prefix after the first chunk


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-dsa"])
def test_compiled_breakable_matches_eager_and_breaks_at_every_island(preset: str) -> None:
    eng, plain = engine(preset, "breakable", compile="traced"), engine(preset, "breakable")
    tel = eng.telemetry
    assert tel.compile_error is None and tel.compile_ms > 0 and tel.num_captured == len(BUCKETS)
    # The same segments and breaks as the uncompiled capture: every island is a break, and nothing else is (a
    # compiled DSA region's sparse attention reads the running layer at capture and is captured, as uncompiled).
    for n in BUCKETS:
        got, want = tel.buckets[n], plain.telemetry.buckets[n]
        assert (got.num_segments, got.num_breaks) == (want.num_segments, want.num_breaks) > (1, 0)
    for lengths in COMPOSITIONS:
        batch = prompts(lengths, seed=len(lengths))
        res, ref = eng.prefill(batch), engine(preset, "eager").prefill(batch)
        assert max_diff(res.logits, ref.logits) <= 1e-5 and torch.equal(res.next_tokens, ref.next_tokens)
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 4), res.batches


def test_replay_runs_no_compiled_code() -> None:
    eng = engine("tiny-dense", "breakable", compile="traced")
    batch = prompts([6, 7])
    expected = eng.prefill(batch).logits.clone()
    compiled, calls = eng.runner.step.layers, []
    compiled._fn, real = (lambda *a: calls.append(a) or real(*a)), compiled._fn
    try:
        res = eng.prefill(batch)
    finally:
        compiled._fn = real
    # Guards and the compiled wrapper ran at capture; the replay launched segments and islands only.
    assert calls == [] and res.batches[0].graph_used and torch.equal(res.logits, expected)


@pytest.mark.parametrize("backend", ["eager", "full"])
def test_compiled_eager_and_full_match_eager(backend: str) -> None:
    eng = engine("tiny-moe", backend, compile="traced")
    assert eng.telemetry.compile_error is None and eng.telemetry.compile_ms > 0
    for lengths in COMPOSITIONS:
        batch = prompts(lengths, seed=1)
        assert max_diff(eng.prefill(batch).logits, engine("tiny-moe", "eager").prefill(batch).logits) <= 1e-5


def test_compiled_dsa_captures_where_tc_piecewise_refuses() -> None:
    compiled = engine("tiny-dsa", "breakable", compile="traced")
    piecewise = engine("tiny-dsa", "tc_piecewise", tc_compiler="traced")
    assert compiled.telemetry.refused_reason is None and compiled.telemetry.num_captured == len(BUCKETS)
    assert "select_topk" in piecewise.telemetry.refused_reason


def test_inductor_under_emulation_falls_back_uncompiled_with_the_reason() -> None:
    eng = engine("tiny-dense", "breakable", compile="inductor")
    assert "compile='traced'" in eng.telemetry.compile_error and eng.runner.step.layers == eng.model.forward_layers
    batch = prompts([5, 9])
    res = eng.prefill(batch)
    assert res.batches[0].graph_used
    assert max_diff(res.logits, engine("tiny-dense", "eager").prefill(batch).logits) <= 1e-5


@pytest.mark.parametrize(("kwargs", "match"), [({"backend": "tc_piecewise", "compile": "traced"}, "tc_compiler"),
                                              ({"compile": "eager"}, "spelled compile='traced'"),
                                              ({"compile": "cudagraphs"}, "inductor, traced")])
def test_bad_compile_options_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine("tiny-dense", device="cpu", **kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("preset", "backend"), [("tiny-dense", "breakable"), ("tiny-moe", "breakable"),
                                               ("tiny-dsa", "breakable"), ("tiny-dense", "full")])
def test_inductor_compiled_graphs_match_eager_in_bf16(preset: str, backend: str) -> None:
    from dataclasses import replace

    from bcg.models import get_preset

    config = replace(get_preset(preset), hidden_size=256, head_dim=64, intermediate_size=512, moe_intermediate_size=64)
    kw = dict(buckets=[16, 32, 64], chunked_prefill_size=64, kv_tokens=1024, dtype="bfloat16", device="cuda",
              seed=0, progress=False)
    full_kw = {"max_requests": 6, "prefix_capacity": 192} if backend == "full" else {}  # room for [150]'s chunks
    eng = Engine(config, backend=backend, compile="inductor", **kw, **full_kw)
    ref = Engine(config, backend="eager", **kw)
    assert eng.telemetry.compile_error is None and eng.telemetry.num_captured == 3
    compiled, calls = eng.runner.step.layers, []
    for lengths in ([3, 7, 12, 1], [40, 9], [64], [150]):
        batch = prompts(lengths, seed=2)
        res, want = eng.prefill(batch), ref.prefill(batch)
        tol = 2e-2 * max(1.0, want.logits.abs().max().item())
        assert (res.logits - want.logits).abs().max().item() <= tol
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 8)
    compiled._fn, real = (lambda *a: calls.append(a) or real(*a)), compiled._fn
    try:
        assert eng.prefill(prompts([20])).batches[0].graph_used and calls == []
    finally:
        compiled._fn = real


def _num_graphs(model, **kw) -> int:
    eng = Engine(model, backend="breakable", compile="traced", device="cpu", buckets=[8, 16], chunked_prefill_size=16,
                 kv_tokens=64, progress=False, seed=0, **kw)
    assert eng.telemetry.compile_error is None
    return eng.runner.step.layers.num_graphs


@pytest.mark.parametrize(("preset", "graphs"), [("tiny-dense", 2), ("tiny-moe", 2), ("tiny-dsa", 3)])
def test_one_graph_per_layer_structure_whatever_the_depth(preset: str, graphs: int) -> None:
    """The first layer (no residual yet) and the others, and for DSA the layers with and without an indexer: the
    number of traces does not grow with the number of layers."""
    from dataclasses import replace

    from bcg.models import get_preset

    for num_layers in (8, 16):
        assert _num_graphs(replace(get_preset(preset), num_layers=num_layers)) == graphs


class _TokenCountBranch(torch.nn.Module):
    """Wraps a layer with code that makes the token count a constant (dynamo specialises it)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden, residual, rope, bcg_region: bool = False):
        if hidden.shape[0] == 16:
            hidden = hidden * 1.0
        return self.layer(hidden, residual, rope, bcg_region)


def test_a_layer_dynamo_cannot_trace_is_refused_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    from bcg.models import get_preset
    from bcg.models.registry import build_model

    model = build_model(get_preset("tiny-dense"), "cpu", torch.float32, seed=0)
    model.layers[1] = _TokenCountBranch(model.layers[1])
    with caplog.at_level("WARNING"):
        eng = Engine(model, backend="breakable", compile="traced", device="cpu", buckets=[8, 16],
                     chunked_prefill_size=16, kv_tokens=64, progress=False)
    error = eng.telemetry.compile_error
    assert "\n" not in error and error.startswith("compile='traced' failed: CompileRefused: torch.compile cannot trace "
                                                  "_TokenCountBranch, layer 1")
    assert "makes the token count a constant" in error and "Fix: run without compile=" in error
    assert [r.name for r in caplog.records] == ["bcg"]  # one line from bcg; dynamo's own log stays quiet
    assert eng.runner.step.layers == model.forward_layers and eng.telemetry.num_captured == 2  # served uncompiled


# --- transformers layers fused by bcg at load: their kernels are custom ops, traced whole on every device. ---
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("g++") is None,
                              reason="Inductor's CPU code needs a C++ compiler (cc or g++)")
HF = dict(buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)
# Every fused kernel of a dense transformers layer: the ops a compiled layer must call, not their references.
HF_LAYER_OPS = {"bcg.rms_norm", "bcg.add_rms_norm", "bcg.qkv_norm_rope", "bcg.silu_and_mul"}


def _transformers_model(arch: str, dtype: torch.dtype = torch.float32, **shape: int) -> torch.nn.Module:
    """A random transformers Llama or Qwen3 (tiny unless ``shape`` says otherwise), weights spread enough that the
    logits are not near-uniform."""
    transformers = pytest.importorskip("transformers")
    dims = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False)
    dims.update(shape)
    config = (transformers.LlamaConfig(**dims) if arch == "llama"
              else transformers.Qwen3Config(**{"head_dim": dims["hidden_size"] // dims["num_attention_heads"], **dims}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.08 if p.ndim >= 2 else 0.1, generator=g)
    return model.to(dtype).eval()


@needs_cc
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_transformers_layers_compile_with_inductor_on_the_cpu(arch: str) -> None:
    """Dynamo, AOT autograd with fake tensors and Inductor take a fused layer whole (fullgraph: no break inside it),
    its kernels as the ops the GPU runs; the compiled stack computes what the uncompiled one does."""
    eng = Engine(_transformers_model(arch), backend="eager", compile="inductor", kernels="fused", device="cpu", **HF)
    plain = Engine(_transformers_model(arch), backend="eager", kernels="fused", device="cpu", **HF)
    assert eng.telemetry.compile_error is None, eng.telemetry.compile_error
    layers = eng.runner.step.layers
    assert layers.num_graphs == 1 and HF_LAYER_OPS <= set(layers.ops), layers.ops
    for lengths in ([3, 13, 7], [30]):
        batch = prompts(lengths, seed=3)
        res, ref = eng.prefill(batch), plain.prefill(batch)
        assert max_diff(res.logits, ref.logits) <= 1e-4 and torch.equal(res.next_tokens, ref.next_tokens)


def test_fused_transformers_layers_compile_and_capture_under_the_emulation() -> None:
    """The traced ops are recorded and replayed by the CPU graph emulation like any op: same breaks as uncompiled."""
    eng = Engine(_transformers_model("qwen3"), backend="breakable", compile="traced", kernels="fused", device="cpu",
                 **HF)
    plain = Engine(_transformers_model("qwen3"), backend="breakable", kernels="fused", device="cpu", **HF)
    assert eng.telemetry.compile_error is None and HF_LAYER_OPS <= set(eng.runner.step.layers.ops)
    for n in HF["buckets"]:
        got, want = eng.telemetry.buckets[n], plain.telemetry.buckets[n]
        assert (got.num_segments, got.num_breaks) == (want.num_segments, want.num_breaks) and got.num_breaks > 0
    batch = prompts([5, 20], seed=4)
    res, ref = eng.prefill(batch), plain.prefill(batch)
    assert all(b.graph_used for b in res.batches)
    assert max_diff(res.logits, ref.logits) <= 1e-5 and torch.equal(res.next_tokens, ref.next_tokens)


# Llama-3.2-1B's and Qwen3-0.6B's layer shapes (scripts/make_checkpoint.py), two layers and a small vocabulary.
REAL_SHAPES = {
    "llama": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                  rope_theta=500000.0),
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_inductor_compiles_fused_transformers_layers_of_real_shapes_on_cuda(arch: str) -> None:
    """compile="inductor" on the transformers path compiles the fused layers (Triton kernels as custom ops) and its
    breakable graphs give the uncompiled engine's greedy tokens wherever its top two logits are not a bf16 tie."""
    kw = dict(HF, kernels="fused", device="cuda", kv_tokens=1024, buckets=[16, 32, 64], chunked_prefill_size=64)
    model = lambda: _transformers_model(arch, torch.bfloat16, num_hidden_layers=3, vocab_size=4096,  # noqa: E731
                                        max_position_embeddings=4096, **REAL_SHAPES[arch]).to("cuda")
    eng = Engine(model(), backend="breakable", compile="inductor", **kw)
    plain = Engine(model(), backend="breakable", **kw)
    assert eng.telemetry.compile_error is None and eng.telemetry.refused_reason is None, eng.telemetry.compile_error
    # one graph per layer structure (the first layer, whose residual input is the embedding, may be its own), never
    # one per layer (three layers here)
    assert eng.runner.step.layers.num_graphs <= 2 and HF_LAYER_OPS <= set(eng.runner.step.layers.ops)
    for lengths in ([3, 13, 40, 7], [64], [150]):
        batch = prompts(lengths, seed=5, vocab=4096)
        res, want = eng.prefill(batch), plain.prefill(batch)
        assert all(b.graph_used for b in res.batches if b.num_tokens >= 8)
        tol = 3e-2 * max(1.0, want.logits.abs().max().item())
        assert (res.logits - want.logits).abs().max().item() <= tol
        top2 = want.logits.float().topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert torch.equal(res.next_tokens[clear], want.next_tokens[clear])
        # The same Triton kernels and GEMMs run either way; Inductor only generates the glue between them.
        assert (res.next_tokens == want.next_tokens).float().mean().item() >= 0.9
