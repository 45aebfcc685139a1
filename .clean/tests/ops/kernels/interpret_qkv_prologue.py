"""The q/k/v projection kernel with the input add + RMSNorm in its prologue under Triton's interpreter, against the
norm and the projection in fp64 followed by ``qkv_norm_rope``'s reference; and the entry point's kernel branch.

Run as ``TRITON_INTERPRET=1 python -m pytest tests/ops/kernels/interpret_qkv_prologue.py`` (not ``test_*``: the
interpreter must be on before anything imports Triton; ``test_qkv_prologue.py`` runs it that way). The exact checks
of the new residual use fp16: the interpreter truncates fp32 -> bf16 where the compiled kernel rounds (bf16 gets a
unit there and one more unit of tolerance on q/k/v, as in ``interpret_qkv_rope.py``).
"""

from __future__ import annotations

import os

import pytest
import qkv_cases
import qkv_prologue_cases as cases
import torch
from kernel_cases import gen

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 from the start"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernel"),
]
# (rows, hidden, heads, kv_heads, head_dim): one row, an odd K (a masked last step), a whole 16-row tile.
SHAPES = [(1, 96, 4, 2, 32), (5, 130, 2, 2, 128), (16, 200, 3, 1, 64)]
SPLITS = [{"split_k": 1}, {"split_k": 3, "block_k": 32}]  # the sums of squares in registers, and split over K


@pytest.fixture(scope="module")
def tk():
    from bcg.ops.kernels import triton_qkv_rope, triton_utils

    assert triton_utils.INTERPRETING
    return triton_qkv_rope


@pytest.mark.parametrize("tiles", SPLITS, ids=["one_split", "k_split"])
@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", SHAPES)
def test_add_and_norm_match_fp64(tk, rows, hidden, heads, kv_heads, dim, tiles):
    cases.check_qkv_rope_norm(cases.direct_norm(tk, **tiles), "cpu", torch.float16, rows, hidden, heads, kv_heads,
                              dim)


@pytest.mark.parametrize("tiles", SPLITS, ids=["one_split", "k_split"])
@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim", SHAPES)
def test_with_per_head_norms_bias_and_the_kv_write(tk, rows, hidden, heads, kv_heads, dim, tiles):
    """Qwen3-like (per-head q/k norms, the whole head in one program) with a bias, which comes after rstd."""
    cases.check_qkv_rope_norm(cases.direct_norm(tk, **tiles), "cpu", torch.float16, rows, hidden, heads, kv_heads,
                              dim, qk_norm=True, bias=True, cache=True)


@pytest.mark.parametrize("tiles", SPLITS, ids=["one_split", "k_split"])
def test_the_norm_without_the_add(tk, tiles):
    cases.check_qkv_rope_norm(cases.direct_norm(tk, **tiles), "cpu", torch.float16, 5, 130, 2, 2, 128, add=False,
                              bias=True)


@pytest.mark.parametrize("num_sms", [1, 8, 132])  # no split, a few, as many as the steps allow
def test_bf16_and_k_splits_of_every_size(tk, num_sms):
    cases.check_qkv_rope_norm(cases.direct_norm(tk, num_sms), "cpu", torch.bfloat16, 16, 300, 3, 1, 32,
                              qk_norm=True, cache=True, ulps=2.0, exact_residual=False)


def test_the_entry_point_runs_the_kernel_and_returns_the_new_residual(tk, monkeypatch):
    """``qkv_proj_rope``'s kernel branch (partials sized for the sums of squares, the four results) with the CPU
    taken for a GPU, against ``fused_add_rms_norm`` then ``qkv_proj_rope``."""
    from bcg.ops import kernels
    from bcg.ops.kernels import qkv_rope

    monkeypatch.setattr(qkv_rope, "kernel_path", lambda impl, x: "triton")
    monkeypatch.setattr(qkv_rope, "num_sms", lambda device: 64)
    assert tk.tiling(9, 512, 8, 64, False, 64).split_k > 1  # the sums of squares go through the partials
    counters = torch.zeros(4096, dtype=torch.int32)  # the CPU build of torch cannot ask about a CUDA capture
    monkeypatch.setattr(qkv_rope, "tile_counters", lambda device, tiles, kernel: counters)
    x, w, positions, freqs = qkv_cases.model_inputs(9, 512, 4, 2, 64, "cpu", torch.float16)
    residual = torch.randn(9, 512, generator=gen(1)).to(torch.float16)
    norm_weight = torch.rand(512, generator=gen(2)).to(torch.float16) + 0.5
    x0, residual0 = x.clone(), residual.clone()
    q, k, v, new_residual = kernels.qkv_proj_rope(x, w, None, positions, freqs, 4, 2, residual=residual,
                                                  norm_weight=norm_weight, norm_eps=cases.NORM_EPS)
    assert torch.equal(x, x0) and torch.equal(residual, residual0), "an input changed"
    assert int(counters.count_nonzero()) == 0
    normed, summed = kernels.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, cases.NORM_EPS,
                                                impl="torch")
    assert torch.equal(new_residual, summed)
    two_steps = kernels.qkv_proj_rope(normed, w, None, positions, freqs, 4, 2, impl="torch")
    for got, e in zip((q, k, v), two_steps):
        torch.testing.assert_close(got.float(), e.float(), rtol=2**-9, atol=2**-9 * float(e.abs().max()))
