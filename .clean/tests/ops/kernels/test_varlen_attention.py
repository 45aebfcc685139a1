"""bcg's varlen attention op on the CPU (its reference): every case of ``attention_cases`` against a double-precision
oracle, in place into ``out`` (rows of no sequence untouched), strided inputs, the refusals, the registered
``torch.ops.bcg.varlen_attention_`` op, and the Triton kernel itself under Triton's interpreter (a fresh process,
when triton is importable)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from attention_cases import CASES, oracle, packed
from interpreter import run_under_interpreter

from bcg.ops.kernels.attention import varlen_attention

HERE = Path(__file__).resolve().parent
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _run(lens_q, lens_k, dtype=torch.bfloat16, extra_q=3, impl="fused", **kw):
    q, k, v, cu_q, cu_k, features = packed(lens_q, lens_k, extra_q=extra_q, dtype=dtype, **kw)
    out = torch.full_like(q, 7.0)
    got = varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out, impl=impl, **features)
    return got, out, oracle(q, k, v, lens_q, lens_k, **features)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_oracle_in_place(name, dtype):
    lens_q, lens_k, features = CASES[name]
    got, out, want = _run(lens_q, lens_k, dtype, **features)
    n = sum(lens_q)
    assert got is out
    assert (out[:n].double() - want[:n]).abs().max().item() <= TOL[dtype]
    assert torch.equal(out[n:], torch.full_like(out[n:], 7.0))  # rows of no sequence are never written


def test_a_row_that_sees_no_key_is_zero():
    _, out, _ = _run([4], [2], extra_q=0)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and out[2:].abs().sum() > 0


def test_strided_token_major_views_as_the_transformers_path_passes_them():
    """(1, H, S, D) -> (S, H, D) transposed views: only the last dim is contiguous."""
    q, k, v, cu_q, cu_k, _ = packed([6, 5], [6, 5])
    qt, kt, vt = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
    assert not qt.is_contiguous()
    a, b = torch.empty_like(q), torch.empty_like(q)
    varlen_attention(q, k, v, cu_q, cu_k, 6, 6, a, softcap=1.0)
    varlen_attention(qt, kt, vt, cu_q, cu_k, 6, 6, b, softcap=1.0)
    assert torch.equal(a, b)


def test_softcap_changes_the_result():
    """The cap is applied (a large cap is plain attention, a small one is not)."""
    q, k, v, cu_q, cu_k, _ = packed([9], [9], seed=2)
    q = q * 8  # scores well past a cap of 0.5
    plain, loose, tight = (torch.empty_like(q) for _ in range(3))
    varlen_attention(q, k, v, cu_q, cu_k, 9, 9, plain)
    varlen_attention(q, k, v, cu_q, cu_k, 9, 9, loose, softcap=1e4)
    varlen_attention(q, k, v, cu_q, cu_k, 9, 9, tight, softcap=0.5)
    assert (plain.float() - loose.float()).abs().max() <= 2e-2
    assert (plain.float() - tight.float()).abs().max() > 0.1


@pytest.mark.parametrize(("change", "message"), [
    (dict(dtype=torch.float32), "fp16 and bf16"),
    (dict(cu_k=torch.tensor([0, 5], dtype=torch.int64)), "cu_seqlens_k must have dtype int32"),
    (dict(softcap=-1.0), "softcap must be positive"),
    (dict(sinks=torch.zeros(3)), "sinks must be one logit per query head"),
    (dict(out=torch.empty(5, 4, 8, dtype=torch.bfloat16)), "out must have shape"),
    (dict(dim=12), "multiple of 8"),
])
def test_refusals_name_the_problem(change, message):
    dtype, dim = change.pop("dtype", torch.bfloat16), change.pop("dim", 16)
    q, k, v, cu_q, cu_k, _ = packed([5], [5], dim=dim, dtype=dtype)
    args = dict(cu_k=cu_k, out=torch.empty_like(q))
    args.update({key: change.pop(key) for key in list(change) if key in args})
    with pytest.raises(RuntimeError, match=message):
        varlen_attention(q, k, v, cu_q, args["cu_k"], 5, 5, args["out"], **change)


def test_the_registered_op_writes_out_and_traces():
    q, k, v, cu_q, cu_k, features = packed([6, 0, 3], [8, 0, 3], sinks=True)
    out, want = torch.zeros_like(q), torch.zeros_like(q)
    torch.ops.bcg.varlen_attention_(q, k, v, cu_q, cu_k, 6, 8, out, 0.25, 1.5, 2, features["sinks"])
    varlen_attention(q, k, v, cu_q, cu_k, 6, 8, want, scale=0.25, softcap=1.5, window_left=2, **features)
    assert torch.equal(out, want) and out.abs().sum() > 0
    torch.library.opcheck(torch.ops.bcg.varlen_attention_.default,
                          (q, k, v, cu_q, cu_k, 6, 8, torch.zeros_like(q), 0.25, 1.5, 2, features["sinks"]),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_code_calls_the_op():
    q, k, v, cu_q, cu_k, _ = packed([4, 3], [4, 3])

    def f(q, k, v, out):
        varlen_attention(q * 1, k, v, cu_q, cu_k, 4, 4, out, softcap=2.0)
        return out + 0

    out_e, out_c = torch.zeros_like(q), torch.zeros_like(q)
    want = f(q, k, v, out_e)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, out_c)
    assert torch.equal(got, want) and torch.equal(out_c, out_e)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the Triton kernel under the interpreter needs triton importable (pip install triton)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernel")
@pytest.mark.interpreter(HERE / "interpret_attention.py")  # started when the session is collected
def test_the_triton_kernel_under_the_interpreter_in_a_fresh_process():
    run_under_interpreter(HERE / "interpret_attention.py", allow_skips=False)
