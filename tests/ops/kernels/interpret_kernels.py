"""The Triton kernels themselves, run by Triton's interpreter on CPU tensors against their references.

Run as ``TRITON_INTERPRET=1 python -m pytest tests/ops/kernels/interpret_kernels.py`` (the file is not named
``test_*`` because the interpreter must be on before anything imports Triton: ``test_kernel_interpret.py`` runs this
file that way in a fresh process). Needs ``triton`` importable and no GPU.

The interpreter rounds fp32 -> bf16 by truncation, so bf16 results get a looser tolerance here (their rounding is
checked by the CUDA tests); its fp16 and fp32 conversions round correctly, so those carry the rounding checks.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from types import SimpleNamespace

import kernel_cases as cases
import mlp_cases
import pytest
import torch
from op_samples import samples
from torch.library import opcheck

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 from the start"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernels"),
]
MODULES = ("triton_utils", "triton_norm", "triton_activation", "triton_rope", "triton_moe", "triton_dsa")


def _version(package: str) -> tuple[int, int]:
    """``(major, minor)`` of an installed package, ``(0, 0)`` when it is not installed (collection must not fail: the
    suite imports this file for its doctests on machines without Triton)."""
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    return tuple(int(v) for v in text.split("+")[0].split(".")[:2])


# Triton 3.6's interpreter turns a loop bound that is a kernel argument into an int with int(ndarray of shape
# (1,)), which numpy >= 2.4 refuses (3.7 does not); only the expert-order kernel loops over a runtime bound.
NUMPY_RUNTIME_LOOPS = _version("numpy") < (2, 4) or _version("triton") >= (3, 7)


@pytest.fixture(scope="module")
def tk():
    import triton

    assert triton.knobs.runtime.interpret
    utils, norm, act, rope, moe, dsa = [importlib.import_module(f"bcg.ops.kernels.{name}") for name in MODULES]
    assert utils.INTERPRETING
    return SimpleNamespace(norm=norm, act=act, rope=rope, moe=moe, dsa=dsa)


class Interpreted:
    """Calls the launchers directly (the entry points would pick the reference for CPU tensors)."""

    ulps = {torch.bfloat16: 2.0}  # fp32 -> bf16 truncates in the interpreter: up to one more unit

    def __init__(self, tk):
        self.tk = tk

    def rms_norm(self, x, w, eps, out):
        self.tk.norm.rms_norm(x, w, eps, out)

    def add_rms_norm(self, x, residual, w, eps, out, residual_out):
        self.tk.norm.add_rms_norm(x, residual, w, eps, out, residual_out)

    def silu_and_mul(self, x, out):
        self.tk.act.silu_and_mul(x, out)

    def clamped_swiglu(self, x, bias, expert, alpha, limit, out):
        self.tk.act.clamped_swiglu(x, bias, expert, alpha, limit, out)

    def qkv_norm_rope(self, *args, cache=None):
        self.tk.rope.qkv_norm_rope(*args, cache)

    def router_topk(self, logits, top_k, renormalize, out_dtype, rule="softmax_topk", correction_bias=None,
                    n_group=1, topk_group=1, scaling=1.0, num_shared=0):
        from bcg.ops.kernels.moe_router import ROUTER_RULES

        weights = cases.poisoned(logits.shape[0], top_k + num_shared, dtype=out_dtype, device="cpu")
        ids = cases.poisoned(logits.shape[0], top_k + num_shared, dtype=torch.int64, device="cpu")
        self.tk.moe.router_topk(logits, top_k, renormalize, ROUTER_RULES.index(rule), correction_bias, n_group,
                                topk_group, scaling, weights, ids)
        return weights, ids

    def expert_order(self, ids, experts):
        from bcg.ops.kernels.moe_permute import ExpertOrder

        n = ids.numel()
        out = ExpertOrder(cases.poisoned(n, dtype=torch.int64, device="cpu"),
                          cases.poisoned(*ids.shape, dtype=torch.int64, device="cpu"),
                          cases.poisoned(experts, dtype=torch.int32, device="cpu"),
                          cases.poisoned(n, dtype=torch.int64, device="cpu"))
        self.tk.moe.expert_order(ids, experts, *out)
        return out

    def moe_combine(self, y, slot, weights, out, bias=None, row_expert=None):
        self.tk.moe.combine(y, slot, weights, out, bias, row_expert)

    def index_topk(self, q, w, pool, read_slots, cu_q, cu_k, num_tokens, max_seqlen_k, topk):
        l_block = 1 << (max(max_seqlen_k, topk, 16) - 1).bit_length()
        out = cases.poisoned(q.shape[0], topk, dtype=torch.int64, device="cpu")
        out.fill_(7)  # not -1: a row the kernel forgets shows
        scratch = torch.empty(5, l_block, dtype=torch.int64)  # five rows a launch: the chunking runs too
        self.tk.dsa.index_topk(q, w, pool, read_slots, cu_q, cu_k, num_tokens, cu_q.shape[0] - 1, l_block, out,
                               scratch)
        return out


@pytest.fixture(scope="module")
def run(tk):
    return Interpreted(tk)


# Bit-exact fractions the interpreter must reach: fp16 differs from torch only where numpy's and torch's fp32 math
# (sum order, rsqrt, exp, sin/cos) round differently by enough to move an fp16 result. An fp32 result moves with
# any such difference (a row's rstd, say), and bf16 is truncated by the interpreter: for those only the tolerance.
MIN_EXACT = {torch.float16: 0.99, torch.float32: None, torch.bfloat16: None}

@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 1000), (1, 1000), (5, 1536), (3, 64)])
def test_rms_norm(run, dtype, rows, hidden):
    cases.check_rms_norm(run, "cpu", dtype, rows, hidden, MIN_EXACT[dtype])


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 64), (1, 1000), (4, 1536)])
def test_fused_add_rms_norm(run, dtype, rows, hidden, in_place):
    cases.check_add_rms_norm(run, "cpu", dtype, rows, hidden, MIN_EXACT[dtype],
                             exact_residual=dtype != torch.bfloat16, in_place=in_place)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,hidden,parts", [(0, 64, 4), (1, 1000, 2), (4, 1536, 4)])
def test_fused_add_rms_norm_partials(run, dtype, rows, hidden, parts):
    cases.check_add_rms_norm_partials(run, "cpu", dtype, rows, hidden, parts, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,inter", [(0, 16), (1, 2816), (3, 500)])
def test_silu_and_mul(run, dtype, rows, inter):
    cases.check_silu_and_mul(run, "cpu", dtype, rows, inter, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows,inter,experts", [(0, 16, 2), (1, 2880, 4), (7, 500, 3)])
def test_clamped_swiglu(run, dtype, rows, inter, experts, bias):
    cases.check_clamped_swiglu(run, "cpu", dtype, rows, inter, experts, bias, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(0, 4, 2, 16), (1, 16, 4, 64), (3, 12, 4, 128), (2, 3, 1, 80)])
def test_qkv_norm_rope(run, dtype, qk_norm, rows, heads, kv_heads, dim):
    cases.check_qkv_norm_rope(run, "cpu", dtype, rows, heads, kv_heads, dim, qk_norm, MIN_EXACT[dtype])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 16, 4, 64), (5, 3, 1, 80)])
def test_qkv_norm_rope_writes_the_kv_cache(run, dtype, rows, heads, kv_heads, dim):
    cases.check_qkv_norm_rope_cache(run, "cpu", dtype, rows, heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,experts,top_k,renormalize", [(0, 8, 2, True), (1, 32, 4, True), (9, 6, 3, False),
                                                            (17, 64, 8, True)])
def test_router_topk(run, dtype, rows, experts, top_k, renormalize):
    cases.check_router_topk(run, "cpu", dtype, rows, experts, top_k, renormalize, MIN_EXACT[dtype])


ROUTER_RULES = {  # (rule, renormalize, correction bias, n_group, topk_group, scaling, shared experts)
    "topk_softmax": ("topk_softmax", False, False, 1, 1, 1.0, 0),
    "sigmoid": ("sigmoid_topk", True, True, 1, 1, 1.0, 0),
    "sigmoid-groups": ("sigmoid_topk", True, True, 4, 2, 2.5, 0),
    "sigmoid-no-renorm-shared": ("sigmoid_topk", False, False, 4, 1, 1.5, 1),
}


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,experts,top_k", [(0, 8, 2), (1, 32, 4), (9, 64, 6)])
@pytest.mark.parametrize("case", list(ROUTER_RULES))
def test_router_rules(run, dtype, rows, experts, top_k, case):
    rule, renormalize, bias, n_group, topk_group, scaling, shared = ROUTER_RULES[case]
    cases.check_router_topk(run, "cpu", dtype, rows, experts, top_k, renormalize, MIN_EXACT[dtype], rule=rule,
                            bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling, num_shared=shared)


@pytest.mark.skipif(not NUMPY_RUNTIME_LOOPS, reason="triton < 3.7's interpreter needs numpy < 2.4 for runtime loops")
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,experts,top_k", [(0, 8, 2), (1, 32, 4), (37, 32, 4), (70, 64, 8), (5, 6, 3)])
def test_expert_order(run, rows, experts, top_k, ids_dtype):
    cases.check_expert_order(run, "cpu", rows, experts, top_k, ids_dtype)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows,hidden,top_k", [(0, 64, 2), (1, 1000, 4), (6, 1536, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_moe_combine(run, dtype, rows, hidden, top_k, bias):
    cases.check_moe_combine(run, "cpu", dtype, rows, hidden, top_k, MIN_EXACT[dtype], bias=bias)


@pytest.mark.skipif(not NUMPY_RUNTIME_LOOPS, reason="triton < 3.7's interpreter needs numpy < 2.4 for runtime loops")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_lens,prefix,topk,ties", [
    ([5, 7], [0, 0], 8, False),            # no prefix: every key is a new row
    ([5, 7, 1], [0, 6, 3], 8, False),      # prefixes, a one-row request
    ([4, 3], [10, 0], 8, True),            # all scores zero: key order decides
    ([20], [70], 16, False),               # a range longer than topk, several key blocks
])
def test_index_topk(run, dtype, q_lens, prefix, topk, ties):
    cases.check_index_topk(run, "cpu", dtype, q_lens, prefix, heads=2, dim=16, topk=topk, ties=ties)


@pytest.mark.skipif(not NUMPY_RUNTIME_LOOPS, reason="triton < 3.7's interpreter needs numpy < 2.4 for runtime loops")
def test_dsa_islands_on_the_kernel_replay_as_the_reference_computes(tk, monkeypatch):
    """The DSA top-k island on the Triton kernel (as on CUDA: bf16 inputs, no fp32 casts in the segment) inside
    breakable graphs, over batches with prefixes, padding and several requests: the logits of eager on the reference."""
    from dataclasses import replace

    from bcg.models.config import get_preset
    from bcg.ops import dsa
    from bcg.ops.kernels import dsa_topk
    from bcg.runtime import Engine

    config = replace(get_preset("tiny-dsa"), num_layers=4, index_share=2)
    options = dict(device="cpu", dtype="bfloat16", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256,
                   progress=False)
    batches = [[list(range(1, 12)), list(range(20, 24))], [list(range(40, 70))], [[5], list(range(80, 93))]]
    reference = Engine(config, backend="eager", **options)
    expected = [reference.prefill(b).logits for b in batches]
    calls = []
    real = tk.dsa.index_topk
    monkeypatch.setattr(tk.dsa, "index_topk", lambda *a: calls.append(a[8]) or real(*a))
    for module in (dsa, dsa_topk):  # the CPU tensors take the kernel's path
        monkeypatch.setattr(module, "use_fused", lambda impl, x: impl == "fused")
    monkeypatch.setattr(dsa_topk, "fused_available", lambda device: True)
    eng = Engine(config, backend="breakable", kernels="fused", **options)
    # the build compiled every sort width a key range of the pool's 256 slots can need, before any request
    assert "DSA top-k kernel compiled for key ranges up to 256" in eng.telemetry.notes
    assert calls[-5:] == [16, 32, 64, 128, 256]
    calls.clear()
    for batch, want in zip(batches, expected):
        res = eng.prefill(batch)
        assert all(b.graph_used for b in res.batches)
        assert (res.logits.float() - want.float()).abs().max() <= 2e-2
    assert len(calls) == len(batches) * config.num_index_groups


@pytest.fixture(scope="module")
def interpreted_ops(tk):
    """Each kernel op's Triton implementation registered as a CPU op of its own (``bcg_interpret::<name>``, same
    schema and fake kernel), so opcheck can hold the launchers to the schemas on CPU tensors."""
    from bcg.ops.kernels.library import KERNEL_OPS

    ops = {}
    for name, spec in KERNEL_OPS.items():
        op = torch.library.custom_op(f"bcg_interpret::{name}", spec.triton, mutates_args=spec.mutates_args)
        op.register_fake(spec.fake)
        ops[name] = getattr(torch.ops.bcg_interpret, name)
    return ops


OP_CASES = [(name, i) for name, args in samples().items() for i in range(len(args))]


@pytest.mark.parametrize(("name", "case"), OP_CASES)
def test_triton_implementations_of_the_ops_pass_opcheck(interpreted_ops, name, case):
    if name == "expert_order" and not NUMPY_RUNTIME_LOOPS:
        pytest.skip("triton < 3.7's interpreter needs numpy < 2.4 for runtime loops")
    args = samples()[name][case]
    opcheck(interpreted_ops[name], args)
    got, want = interpreted_ops[name](*args), getattr(torch.ops.bcg, name)(*samples()[name][case])
    if name == "fused_add_rms_norm_":
        got, want = args[:2], samples()[name][case][:2]  # reference written into fresh copies of the samples
        torch.ops.bcg.fused_add_rms_norm_(*want, *samples()[name][case][2:])
    for g, e in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want))):
        assert g.shape == e.shape and g.dtype == e.dtype and g.stride() == e.stride()
        rtol = cases.RTOL[g.dtype] * 2 if g.dtype.is_floating_point else 0  # bf16 truncates here: one more unit
        atol = rtol
        if name == "clamped_swiglu" and g.dtype == torch.bfloat16 and e.numel():
            atol = 4 * cases.RTOL[g.dtype] * e.float().abs().max().item()  # six truncations, `up + 1` cancels
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols,inner,num_sms", mlp_cases.SHAPES)
def test_swiglu_down(run, dtype, rows, cols, inner, num_sms):
    tk = importlib.import_module("bcg.ops.kernels.triton_down_proj")
    mlp_cases.check_swiglu_down(mlp_cases.direct(tk), "cpu", dtype, rows, cols, inner, num_sms,
                                   ulps=run.ulps.get(dtype, 1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,inter,num_sms", mlp_cases.GATE_UP_SHAPES)
def test_gate_up_silu(run, dtype, rows, hidden, inter, num_sms):
    tk = importlib.import_module("bcg.ops.kernels.triton_gate_up")
    mlp_cases.check_gate_up_silu(mlp_cases.direct_gate_up(tk), "cpu", dtype, rows, hidden, inter, num_sms,
                                 ulps=run.ulps.get(dtype, 1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,inter,num_sms", mlp_cases.GATE_UP_NORM_SHAPES)
def test_gate_up_silu_with_the_norm_folded_in(run, dtype, rows, hidden, inter, num_sms):
    tk = importlib.import_module("bcg.ops.kernels.triton_gate_up")
    mlp_cases.check_gate_up_silu(mlp_cases.direct_gate_up(tk), "cpu", dtype, rows, hidden, inter, num_sms,
                                 ulps=run.ulps.get(dtype, 1.0), norm=True)
