"""gemma2, gemma3 and gpt-oss (soft-caps, sliding windows, sinks, custom scales) on the transformers path with the
"triton" attention backend: every layer's attention is bcg's varlen kernel (its reference on the CPU, in bf16 as the
GPU runs it), and the logits and greedy tokens are transformers' own forward's."""

from __future__ import annotations

import pytest
import torch
from hf_cases import make_model, one_thread, prompts, reference_copy, reference_logits

import bcg.ops.attention.varlen as varlen_module
from bcg.runtime import Engine

REL_TOL = 3e-2  # bf16, relative to the largest logit
OPTS = dict(buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def _compare(res, want: torch.Tensor) -> None:
    """Logits within bf16 tolerance; the same greedy token wherever transformers' top-2 margin clears it."""
    tol = REL_TOL * max(1.0, want.abs().max().item())
    assert (res.logits - want).abs().max().item() <= tol
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert clear.any() and torch.equal(res.next_tokens[clear], want.argmax(-1)[clear])


def _run(arch: str, device: str, monkeypatch) -> None:
    calls = []
    real = varlen_module.varlen_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen_module, "varlen_attention", spy)
    model = make_model(arch)
    ref = reference_copy(model)  # fp32, transformers' eager attention
    eng = Engine(model.to(device, torch.bfloat16), device=device, backend="breakable", attention_backend="triton",
                 full_graph_tokens=0, **OPTS)  # every batch through the Triton island
    assert eng.telemetry.refused_reason is None and eng.telemetry.attention_backend == "triton"
    res = eng.prefill(prompts())
    assert all(b.graph_used for b in res.batches)
    _compare(res, reference_logits(ref.to(device), prompts()))
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None):
        assert calls and all(c.get("softcap") == cfg.attn_logit_softcapping for c in calls)
    assert any(c.get("window_left") == cfg.sliding_window - 1 for c in calls)
    eng.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "gpt_oss"])
def test_triton_backend_matches_transformers_on_cpu(arch, monkeypatch):
    _run(arch, "cpu", monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "gpt_oss"])
def test_triton_backend_matches_transformers_on_cuda(arch, monkeypatch):
    _run(arch, "cuda", monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_default_runs_gemma2_soft_caps_on_the_triton_kernel(monkeypatch):
    """The default backend on CUDA ("varlen") sends gemma2's soft-capped layers to the Triton kernel, not the
    per-request feature path, and matches transformers."""
    calls = []
    real = varlen_module.varlen_attention
    monkeypatch.setattr(varlen_module, "varlen_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    model = make_model("gemma2")
    ref = reference_copy(model)
    eng = Engine(model.to("cuda", torch.bfloat16), device="cuda", backend="breakable", **OPTS)
    assert eng.telemetry.attention_backend == "varlen"
    res = eng.prefill(prompts())
    _compare(res, reference_logits(ref.to("cuda"), prompts()))
    assert calls and all(c.get("softcap") == 1.0 for c in calls)
