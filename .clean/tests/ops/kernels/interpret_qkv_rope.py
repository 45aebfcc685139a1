"""The q/k/v projection with RoPE in its epilogue (``triton_qkv_rope``) under Triton's interpreter, against the
projection in fp64 followed by ``qkv_norm_rope``'s reference.

Run as ``TRITON_INTERPRET=1 python -m pytest tests/ops/kernels/interpret_qkv_rope.py`` (not ``test_*``: the
interpreter must be on before anything imports Triton; ``test_qkv_rope.py`` runs it that way). The interpreter
truncates fp32 -> bf16, so bf16 gets one more unit of tolerance than the compiled kernel would need.
"""

from __future__ import annotations

import os

import pytest
import qkv_cases as cases
import torch

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 from the start"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernel"),
]
ULPS = {torch.bfloat16: 2.0, torch.float16: 1.0}


@pytest.fixture(scope="module")
def tk():
    from bcg.ops.kernels import triton_qkv_rope, triton_utils

    assert triton_utils.INTERPRETING
    return triton_qkv_rope


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", cases.SHAPES)
def test_matches_the_two_steps(tk, dtype, rows, hidden, heads, kv_heads, dim):
    cases.check_qkv_rope(cases.direct(tk), "cpu", dtype, rows, hidden, heads, kv_heads, dim, ulps=ULPS[dtype])


@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", [(5, 96, 4, 2, 32), (3, 130, 2, 2, 128)])
def test_per_head_norms_bias_and_the_kv_write(tk, rows, hidden, heads, kv_heads, dim):
    cases.check_qkv_rope(cases.direct(tk), "cpu", torch.float16, rows, hidden, heads, kv_heads, dim, qk_norm=True,
                         bias=True, cache=True)


@pytest.mark.parametrize("tiles", [{"half_n": 32}, {"block_m": 16, "block_k": 32}, {"block_k": 128},
                                   {"split_k": 1}, {"split_k": 5, "block_k": 16}])
def test_other_tiles_and_splits(tk, tiles):
    cases.check_qkv_rope(cases.direct(tk, **tiles), "cpu", torch.float16, 33, 200, 2, 1, 64, bias=True, cache=True)


@pytest.mark.parametrize("num_sms", [1, 8, 132])  # no split, a few, as many as the steps allow
def test_k_splits_of_every_size(tk, num_sms):
    cases.check_qkv_rope(cases.direct(tk, num_sms), "cpu", torch.float16, 17, 300, 3, 1, 32, qk_norm=True,
                         cache=True)
