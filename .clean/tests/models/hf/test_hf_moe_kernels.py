"""Kernels a fused MoE block launches, counted on the CPU: the proxy in CI for issue 31's target (a transformers MoE
layer within the native MoE path's kernels + 2; the H200 measures the real ones, ``benchmarks/hf_speed.py``).

The block's forward is captured into an emulated graph, which records the ops a CUDA graph would hold a kernel for
(views, metadata and allocations are not recorded), with bcg's kernels called through their ``torch.ops.bcg`` ops, as
a traced forward calls them, so each is one recorded op where its CPU reference is several."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from hf_cases import make_model, one_thread

from bcg.emulation import EmulatedGraph
from bcg.models.config import get_preset
from bcg.models.hf.fused_moe import FusedMoE
from bcg.models.hf.model import HFCausalLM
from bcg.models.moe import MoEFFN

# The native gptoss-moe MoE FFN on the fused kernels: router GEMM, router, expert order, gather, two grouped GEMMs,
# SiLU-and-multiply, combine.
NATIVE_KERNELS = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture
def as_ops(monkeypatch):
    """bcg's fused entry points call their custom ops (one op each) instead of their multi-op CPU references."""
    for name, module in list(sys.modules.items()):
        if name.startswith("bcg.ops.kernels.") and hasattr(module, "kernel_path"):
            monkeypatch.setattr(module, "kernel_path", lambda impl, x: "op" if impl == "fused" else "torch")


def _kernels(fn) -> tuple[int, list[str]]:
    graph = EmulatedGraph()
    with torch.inference_mode():
        graph.capture_begin()
        try:
            fn()
        finally:
            graph.capture_end()
    return graph.num_ops, [str(op.func) for op in graph._ops]


def _native_block() -> MoEFFN:
    config = replace(get_preset("gptoss-moe"), hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     moe_intermediate_size=32, num_layers=1)
    ffn = MoEFFN(config)
    torch.nn.init.normal_(ffn.gate.weight)
    ffn.kernels = "fused"
    ffn.prepare()
    return ffn


def test_the_native_moe_ffn_runs_its_eight_kernels(as_ops):
    ffn, x = _native_block(), torch.randn(8, 64)
    count, ops = _kernels(lambda: ffn(x))
    assert ffn.use_grouped_mm and count == NATIVE_KERNELS, ops
    assert sum(op.startswith("bcg.") for op in ops) == 4, ops  # router, expert order, SiLU-and-multiply, combine


@pytest.mark.parametrize(("arch", "dtype"), [("qwen3_moe", torch.float32), ("mixtral", torch.float32),
                                             ("gpt_oss", torch.float32), ("glm4_moe", torch.float32),
                                             ("glm4_moe", torch.bfloat16)])
def test_a_fused_moe_block_runs_at_most_the_native_kernels_plus_two(arch, dtype, as_ops):
    """Every family runs the native FFN's 8 in fp32: glm4_moe's shared experts inside the grouped GEMMs, gpt_oss's
    down bias inside the combine. In bf16 glm4_moe's input is cast for the fp32 router GEMM, and on the CPU the
    combine's weights too (CUDA's combine reads them as fp32)."""
    hf = make_model(arch, dtype=dtype)
    model = HFCausalLM(hf)
    model.set_kernels("fused")
    block = next(m for m in hf.modules() if isinstance(m, FusedMoE))
    x = torch.randn(1, 8, hf.config.hidden_size, dtype=dtype)
    count, ops = _kernels(lambda: block(x))
    assert block.use_grouped_mm and not any(op in ops for op in ("aten.topk.default", "aten.softmax.int")), ops
    assert count <= NATIVE_KERNELS + 2, ops
    if dtype == torch.float32:
        assert count == NATIVE_KERNELS, ops


def test_a_bf16_fp32_router_keeps_its_own_weight_for_one_gemm():
    """glm4_moe's router computes in fp32: its bf16 weight is kept beside the fp32 copy, so CUDA can run the logits
    as one GEMM of the bf16 operands with an fp32 result; routers that compute in their own dtype keep no second."""
    for arch, lowp in (("glm4_moe", True), ("qwen3_moe", False), ("gpt_oss", False)):
        hf = make_model(arch, dtype=torch.bfloat16)
        HFCausalLM(hf)
        router = next(m for m in hf.modules() if isinstance(m, FusedMoE)).spec.router
        assert (router.weight_lowp is not None) == lowp, arch
        if lowp:
            assert router.weight.dtype == torch.float32 and router.weight_lowp.dtype == torch.bfloat16
            torch.testing.assert_close(router.weight, router.weight_lowp.float(), rtol=0, atol=0)
            x = torch.randn(8, hf.config.hidden_size, dtype=torch.bfloat16)
            # off CUDA the fp32 path runs: the router's own computation, exactly
            want = torch.nn.functional.linear(x.float(), router.weight)
            assert torch.equal(router.logits(x), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bf16_fp32_router_on_cuda_is_one_kernel_and_the_fp32_logits():
    from torch.profiler import ProfilerActivity, profile

    hf = make_model("glm4_moe", dtype=torch.bfloat16)
    HFCausalLM(hf)
    router = next(m for m in hf.modules() if isinstance(m, FusedMoE)).spec.router
    router = replace(router, weight=router.weight.cuda(), weight_lowp=router.weight_lowp.cuda())
    x = torch.randn(64, router.weight.shape[1], dtype=torch.bfloat16, device="cuda")
    got = router.logits(x)
    want = torch.nn.functional.linear(x.float(), router.weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same products; only the summation order
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        router.logits(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 2, kernels  # one GEMM (two where cuBLAS splits K): the cast, GEMM and reduce were three
