"""The optional "flash4" backend (FlashAttention 4, ``flash-attn-4``): where the package does not import it refuses
with the reason and the command; its island wiring runs on the CPU through a stand-in module with FlashAttention 4's
interface (bcg's varlen reference behind it), against eager SDPA, cached prefixes included; on CUDA, where the package
imports, its kernel against FlashAttention 2."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from engine_cache import poison_scratch

import bcg.ops.attention.flash4 as flash4
from bcg.ops.attention import attention_backend
from bcg.ops.kernels.attention import varlen_attention
from bcg.runtime import Engine

COMMON = dict(device="cpu", dtype="bfloat16", progress=False, seed=0, buckets=[4, 16, 32], chunked_prefill_size=32)


def _stand_in(calls: list[dict], returns_tuple: bool) -> types.ModuleType:
    """A ``flash_attn.cute`` with FlashAttention 4's varlen interface: keyword metadata, ``(out, lse)`` or ``out``."""
    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        calls.append({"causal": causal, "max_seqlen_q": max_seqlen_q, "dtype": cu_seqlens_q.dtype})
        out = torch.empty_like(q)
        varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out)
        return (out, None) if returns_tuple else out

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The stand-in installed as flash_attn.cute, the backend let onto the CPU; the kernel's calls."""
    calls: list[dict] = []
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.cute = _stand_in(calls, returns_tuple=True)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package.cute)
    monkeypatch.setattr(flash4, "_importable", lambda: True)
    monkeypatch.setattr(flash4.Flash4Attention, "is_usable", classmethod(lambda cls, device, dtype: None))
    return calls


@pytest.mark.skipif(flash4._importable(), reason="flash-attn-4 is installed here: the refusal cannot be seen")
def test_without_the_package_it_refuses_with_the_reason_and_the_command() -> None:
    assert attention_backend("flash4") is flash4.Flash4Attention
    reason = flash4.Flash4Attention.is_usable(torch.device("cuda"), torch.bfloat16)
    assert "flash-attn-4 is not installed" in reason and "pip install flash-attn-4" in reason
    with pytest.raises(ValueError, match="attention_backend='flash4' cannot run here: flash-attn-4 is not installed"):
        Engine("tiny-dense", device="cpu", dtype="bfloat16", attention_backend="flash4", progress=False)


@pytest.mark.parametrize("returns_tuple", [True, False])
def test_the_kernel_passes_the_metadata_and_writes_out(monkeypatch: pytest.MonkeyPatch, returns_tuple: bool) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(flash4, "_module", lambda: _stand_in(calls, returns_tuple))
    q, k, v = (torch.randn(6, h, 16, dtype=torch.bfloat16) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    out, want = torch.full_like(q, float("nan")), torch.empty_like(q)
    flash4.flash4_kernel(q, k, v, cu, cu, 4, 4, out)
    varlen_attention(q, k, v, cu, cu, 4, 4, want)
    assert torch.equal(out, want) and calls == [{"causal": True, "max_seqlen_q": 4, "dtype": torch.int32}]


def test_an_engine_on_the_backend_matches_eager_sdpa(installed: list[dict]) -> None:
    eng = Engine("tiny-dense", attention_backend="flash4", **COMMON)
    ref = Engine("tiny-dense", backend="eager", attention_backend="sdpa", **COMMON)
    try:
        assert eng.telemetry.attention_backend == "flash4"
        gen = torch.Generator().manual_seed(0)
        for lengths in ([5, 3, 2], [9, 7], [75, 3]):  # padded rows; a full bucket; chunks over a cached prefix
            prompts = [torch.randint(0, eng.model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
            poison_scratch(eng)
            installed.clear()
            got, want = eng.prefill(prompts), ref.prefill(prompts)
            assert (got.logits - want.logits).abs().max().item() <= 5e-2
            assert torch.equal(got.next_tokens, want.next_tokens)
            assert len(installed) >= eng.model.config.num_layers * len(got.batches)  # every island ran it
    finally:
        eng.close()
        ref.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_matches_flash_attention_2() -> None:
    if flash4.Flash4Attention.is_usable(torch.device("cuda"), torch.bfloat16) is not None:
        pytest.skip("flash-attn-4 does not run here (an optional package: bcg never requires it)")
    from bcg.ops.attention.varlen import flash_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(300, h, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for h in (16, 4, 4))
    cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
    got, want = torch.empty_like(q), torch.empty_like(q)
    flash4.flash4_kernel(q, k, v, cu, cu, 200, 200, got)
    flash_kernel(q, k, v, cu, cu, 200, 200, want)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-6)
