"""The "triton" attention backend through a whole engine on the CPU, as the GPU runs it: the Triton varlen kernel's
reference in bf16 in every island of breakable graphs (emulated), against eager SDPA, with and without cached
prefixes, padded rows over a NaN scratch slot, full buckets and one-token batches; and the varlen backend's routing
of soft-capped layers to that kernel where it runs."""

from __future__ import annotations

import pytest
import torch
from engine_cache import poison_scratch

import bcg.ops.attention.varlen as varlen_module
from bcg.ops.attention import AttentionFeatures, TritonAttention, VarlenAttention, attention_backend
from bcg.ops.kv_cache import KVPool
from bcg.runtime import Engine

BUCKETS = [1, 4, 16, 32]
COMMON = dict(device="cpu", dtype="bfloat16", progress=False, seed=0, buckets=BUCKETS, chunked_prefill_size=32)
TOL = 5e-2  # bf16 logits of a 2-layer model


@pytest.fixture(scope="module")
def engines():
    eng = Engine("tiny-dense", attention_backend="triton", prefix_cache=True, **COMMON)
    ref = Engine("tiny-dense", backend="eager", attention_backend="sdpa", prefix_cache=False, **COMMON)
    yield eng, ref
    eng.close()
    ref.close()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every call of bcg's varlen kernel entry point through the islands, with its keyword features."""
    calls = []
    real = varlen_module.varlen_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen_module, "varlen_attention", spy)
    return calls


def test_the_backend_is_selectable_and_says_where_it_cannot_run():
    assert attention_backend("triton") is TritonAttention
    assert TritonAttention.is_usable(torch.device("cpu"), torch.bfloat16) is None
    assert "float16/bfloat16" in TritonAttention.is_usable(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="attention_backend='triton' cannot run here"):
        Engine("tiny-dense", device="cpu", dtype="float32", attention_backend="triton", progress=False)


@pytest.mark.parametrize(("name", "lengths"), [
    ("one-token", [1]),  # bucket 1, filled: an empty padded sequence with the longest query 1 (GQA)
    ("one-token-each", [1, 1, 1]),
    ("fills-bucket", [9, 7]),
    ("padded", [5, 3, 2]),
    ("chunked", [75, 3]),  # later chunks attend over the cached earlier ones (prefix path)
])
def test_prefill_matches_eager_sdpa(engines, kernel_calls, name, lengths):
    eng, ref = engines
    assert eng.telemetry.attention_backend == "triton" and eng.telemetry.notes == []
    gen = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(0, eng.model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    poison_scratch(eng)
    got, want = eng.prefill(prompts), ref.prefill(prompts)
    assert (got.logits - want.logits).abs().max().item() <= TOL
    assert torch.equal(got.next_tokens, want.next_tokens)
    assert all(b.graph_used for b in got.batches), [b.reason for b in got.batches]
    assert len(kernel_calls) >= eng.model.config.num_layers * len(got.batches)  # every island ran the kernel


def _island_inputs(num_tokens=6, padded=8):
    """A one-request context over a fresh pool, and q/k/v for its padded rows."""
    from bcg.ops.attention import single_request_context

    pool = KVPool(32, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    ctx = single_request_context(num_tokens, pool, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, 4, 16, generator=gen).bfloat16()
    k, v = (torch.randn(num_tokens, 2, 16, generator=gen).bfloat16() for _ in range(2))
    return pool, ctx, q, k, v


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
@pytest.mark.parametrize("runs_triton", [False, True])
def test_varlen_sends_soft_capped_and_sink_layers_to_the_triton_kernel_where_it_runs(monkeypatch, kernel_calls,
                                                                                      runs_triton, feature):
    """On CUDA with Triton (stood in for here) a soft-capped layer, or one with sinks, takes bcg's kernel; elsewhere
    the feature path's exact math. Both give the same numbers."""
    monkeypatch.setattr(varlen_module, "runs_triton_varlen", lambda q, v: runs_triton)
    pool, ctx, q, k, v = _island_inputs()
    extra = {"softcap": 0.8} if feature == "softcap" else {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}
    features = AttentionFeatures(scale=0.3, window=3, **extra)
    backend = VarlenAttention(pool)
    out = torch.empty_like(q)
    backend.attend_with(ctx, q, k, v, out, 0, features)
    assert len(kernel_calls) == int(runs_triton)
    if runs_triton:
        assert kernel_calls[0] == dict(scale=0.3, softcap=extra.get("softcap"), window_left=2,
                                       sinks=extra.get("sinks"))
    want = torch.empty_like(q)
    TritonAttention(pool).attend_with(ctx, q, k, v, want, 0, features)
    from bcg.ops.attention.features import reference_attention

    exact = torch.empty_like(q)
    reference_attention(q, k, v, ctx, features, exact)
    assert (out.float() - exact.float()).abs().max() <= 2e-2 and (want.float() - exact.float()).abs().max() <= 2e-2


@pytest.mark.parametrize("runs_triton", [False, True])
def test_varlen_runs_the_triton_kernel_from_its_bucket_on(monkeypatch, kernel_calls, runs_triton):
    """Buckets of TRITON_FROM_TOKENS or more take bcg's kernel where it runs (stood in for here), smaller ones
    FlashAttention; the numbers are the same either way."""
    monkeypatch.setattr(varlen_module, "runs_triton_varlen", lambda q, v: runs_triton)
    monkeypatch.setattr(varlen_module, "TRITON_FROM_TOKENS", 6)
    monkeypatch.setattr(varlen_module, "TRITON_FROM_TOKENS_WIDE", 6)
    pool, ctx, q, k, v = _island_inputs(num_tokens=6)
    backend = VarlenAttention(pool)
    out, small = torch.empty_like(q), torch.empty_like(q[:4])
    backend.attend(ctx, q, k, v, out, 0)  # a 6-row bucket
    assert len(kernel_calls) == int(runs_triton)
    _, small_ctx, q4, k4, v4 = _island_inputs(num_tokens=4)
    backend.attend(small_ctx, q4, k4, v4, small, 0)  # below the threshold: FlashAttention only
    assert len(kernel_calls) == int(runs_triton)
    want = torch.empty_like(q)
    TritonAttention(pool).attend(ctx, q, k, v, want, 0)
    assert (out.float() - want.float()).abs().max() <= 2e-2


@pytest.mark.parametrize(("value", "want"), [("", "2048 1024"), ("512", "512 512"), ("0", "BCG_TRITON_VARLEN_FROM='0'"),
                                             ("1k", "BCG_TRITON_VARLEN_FROM='1k'")])
def test_the_island_threshold_is_a_debug_switch(value, want):
    """BCG_TRITON_VARLEN_FROM moves where the island switches to bcg's kernel; a value that is no positive count
    stops the import and names the variable."""
    import os
    import subprocess
    import sys

    code = "from bcg.ops.attention import varlen; print(varlen.TRITON_FROM_TOKENS, varlen.TRITON_FROM_TOKENS_WIDE)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BCG_TRITON_VARLEN_FROM": value})
    assert want in (run.stdout if run.returncode == 0 else run.stderr)
    assert (run.returncode == 0) == want[0].isdigit()


def test_wide_attention_takes_the_kernel_from_a_smaller_bucket():
    """q heads x head dim of WIDE_ATTENTION or more: TRITON_FROM_TOKENS_WIDE; narrower: TRITON_FROM_TOKENS."""
    wide = torch.empty(1, 16, varlen_module.WIDE_ATTENTION // 16)
    narrow = torch.empty(1, 16, varlen_module.WIDE_ATTENTION // 32)
    assert varlen_module.triton_from_tokens(wide) == varlen_module.TRITON_FROM_TOKENS_WIDE
    assert varlen_module.triton_from_tokens(narrow) == varlen_module.TRITON_FROM_TOKENS
