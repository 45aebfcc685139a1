"""BCG_NORM_FUSION on the CPU: a dense layer's post-attention add + RMSNorm folded into the o projection's GEMM and
the gate/up kernel (there its references: rms_norm, then the two steps). The fold gives the unfolded layer's outputs
and residual stream within rounding, leaves the first layer's input unwritten, takes a kernel away, and is not taken
where it would be wrong or has no kernel to fold into. The kernel itself: tests/ops/kernels (interpreter, sm_90
compile, CUDA); the bf16 model under CUDA graphs: test_norm_fusion_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from bcg import env
from bcg.models import build_model, get_preset
from bcg.models.dense import DenseLM, folds_input_norm, folds_post_attention_norm
from bcg.ops import kernels
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.ops.parallel import TensorParallel
from bcg.runtime.batch import PrefillBatch, PrefillItem

# fp32: the GEMM's add and one rounding fewer move the last bits; bf16: a unit of the residual stream's rounding,
# carried through two layers.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _model(dtype: torch.dtype = torch.float32, impl: str = "fused", **changes):
    model = build_model(replace(get_preset("tiny-dense"), **changes), "cpu", dtype, seed=0)
    with torch.no_grad():  # norm scales other than one, and biases that are not zero: both must be wired in
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "bias")):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2, generator=torch.Generator().manual_seed(1))
    model.set_kernels(impl)
    return model


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_gives_the_unfolded_models_outputs(dtype, prefill, monkeypatch):
    model = _model(dtype)
    tokens = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    results, norm_kernels, real = {}, {}, kernels.fused_add_rms_norm
    for on in (False, True):
        monkeypatch.setattr(env, "NORM_FUSION", on)
        calls: list[int] = []
        monkeypatch.setattr(kernels, "fused_add_rms_norm",
                            lambda *a, calls=calls, **k: calls.append(1) or real(*a, **k))
        pool = KVPool.for_model(model.config, 64, "cpu", dtype)
        results[on] = prefill(model, pool, [(None, tokens[:9]), (None, tokens[9:])], num_padded_tokens=32)
        norm_kernels[on] = len(calls)
    # Two layers: the post-attention add + norm of both is gone; the second layer's input add + norm stays.
    assert norm_kernels == {False: 3, True: 1}
    assert _rel(results[True].hidden, results[False].hidden) <= TOL[dtype]
    assert _rel(results[True].logits, results[False].logits) <= TOL[dtype]


def _layer_inputs(model, rows: int = 12):
    """A forward context for ``rows`` tokens of two requests, the rope, and a hidden state and residual stream."""
    pool = KVPool.for_model(model.config, 64, "cpu", model.embed_tokens.weight.dtype)
    batch = PrefillBatch([PrefillItem(list(range(5)), pool.alloc(5)), PrefillItem(list(range(7)), pool.alloc(7))],
                         pool)
    g = torch.Generator().manual_seed(3)
    dtype, hidden = model.embed_tokens.weight.dtype, model.config.hidden_size
    h, r = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    return batch.to_context(rows), model.rotary.rope(batch.positions), h, r


def test_the_residual_to_the_next_layer_is_the_sum_and_the_first_layers_input_stays(monkeypatch):
    model = _model()
    context, rope, h, r = _layer_inputs(model)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(env, "NORM_FUSION", on)
        assert folds_post_attention_norm(model.layers[1]) == on
        first_input = h.clone()
        with torch.no_grad(), forward_context(context):
            out[on, 0] = model.layers[0](first_input, None, rope)
            assert torch.equal(first_input, h), "the first layer wrote its input (a graph's static input)"
            out[on, 1] = [t.clone() for t in model.layers[1](h.clone(), r.clone(), rope)]
            expected = r + h + model.layers[1].self_attn(model.layers[1].input_layernorm(r + h), rope)
    for layer in (0, 1):
        for got, want in zip(out[True, layer], out[False, layer]):
            # Unfolded, the MLP may hand the next layer its down projection's split-K partials: their sum is its output.
            want = want.sum(0) if want.dim() == got.dim() + 1 else want
            assert _rel(got, want) <= TOL[torch.float32]
    assert _rel(out[True, 1][1], expected) <= TOL[torch.float32]  # h + attn(norm(h)) with h = r + hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_fold_hands_the_add_and_norm_to_the_qkv_projection(dtype, prefill, monkeypatch):
    """BCG_INPUT_NORM_FUSION: the layer's input add + norm go to the q/k/v projection (its prologue on CUDA; here its
    reference, the add + norm kernel's arithmetic into new buffers), with the same outputs within rounding."""
    model = _model(dtype)
    tokens = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(env, "NORM_FUSION", True)
    real, handed = kernels.qkv_proj_rope, []
    monkeypatch.setattr(kernels, "qkv_proj_rope", lambda *a, **k: handed.append(
        (k.get("norm_weight") is not None, k.get("residual") is not None)) or real(*a, **k))
    results = {}
    for on in (False, True):
        monkeypatch.setattr(env, "INPUT_NORM_FUSION", on)
        assert all(folds_input_norm(layer) == on for layer in model.layers)
        handed.clear()
        pool = KVPool.for_model(model.config, 64, "cpu", dtype)
        results[on] = prefill(model, pool, [(None, tokens[:9]), (None, tokens[9:])], num_padded_tokens=32)
        # Off, the projection gets normed rows; on, the first layer hands it the norm, the second the add too.
        assert handed == ([(False, False)] * 2 if not on else [(True, False), (True, True)])
    assert _rel(results[True].hidden, results[False].hidden) <= TOL[dtype]
    assert _rel(results[True].logits, results[False].logits) <= TOL[dtype]


def test_the_input_fold_leaves_the_first_layers_input_and_the_residual_it_was_given(monkeypatch):
    model = _model()
    context, rope, h, r = _layer_inputs(model)
    monkeypatch.setattr(env, "NORM_FUSION", True)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(env, "INPUT_NORM_FUSION", on)
        first_input, given = h.clone(), r.clone()
        with torch.no_grad(), forward_context(context):
            out[on, 0] = model.layers[0](first_input, None, rope)
            out[on, 1] = [t.clone() for t in model.layers[1](h.clone(), given, rope)]
        assert torch.equal(first_input, h), "the first layer wrote its input (a graph's static input)"
        if on:  # the sum went to a new tensor: the residual handed in is only read
            assert torch.equal(given, r)
    for layer in (0, 1):
        for got, want in zip(out[True, layer], out[False, layer]):
            # Unfolded, the MLP may hand the next layer its down projection's split-K partials: their sum is its output.
            want = want.sum(0) if want.dim() == got.dim() + 1 else want
            assert _rel(got, want) <= TOL[torch.float32]


def test_the_input_fold_needs_the_folded_layer_and_the_fused_projection(monkeypatch):
    monkeypatch.setattr(env, "INPUT_NORM_FUSION", True)
    model = _model(impl="torch")
    assert not any(folds_input_norm(layer) for layer in model.layers)  # no q/k/v kernel to fold into
    sharded = DenseLM(get_preset("tiny-dense"), TensorParallel(2, 0))
    sharded.set_kernels("fused")
    assert not any(folds_input_norm(layer) for layer in sharded.layers)
    monkeypatch.setattr(env, "NORM_FUSION", False)  # the layer is not folded: its input norm stays where it is
    seen: list[bool] = []
    real = kernels.qkv_proj_rope
    monkeypatch.setattr(kernels, "qkv_proj_rope", lambda *a, **k: seen.append("norm_weight" in k) or real(*a, **k))
    fused_model = _model()
    context, rope, h, r = _layer_inputs(fused_model)
    with torch.no_grad(), forward_context(context):
        fused_model.layers[1](h, r, rope)
    assert seen == [False]


@pytest.mark.parametrize(("changes", "fusion", "impl"), [
    ({"attention_bias": True}, "gate_up", "fused"),  # the o projection's bias
    ({}, "down", "fused"), ({}, "none", "fused"),  # no gate/up kernel to fold into
    ({}, "gate_up", "torch"),  # the plain torch ops
])
def test_the_fold_is_not_taken_where_it_does_not_apply(changes, fusion, impl, prefill, monkeypatch):
    monkeypatch.setattr(env, "NORM_FUSION", True)
    monkeypatch.setattr(env, "MLP_FUSION", fusion)
    model = _model(impl=impl, **changes)
    assert not any(folds_post_attention_norm(layer) for layer in model.layers)
    seen = []
    real = kernels.gate_up_silu
    monkeypatch.setattr(kernels, "gate_up_silu", lambda *a, **k: seen.append(k.get("norm_weight")) or real(*a, **k))
    tokens = list(range(10))
    on = prefill(model, KVPool.for_model(model.config, 32, "cpu", torch.float32), [(None, tokens)])
    assert all(w is None for w in seen), "an MLP was handed the norm to fold"
    monkeypatch.setattr(env, "NORM_FUSION", False)
    off = prefill(model, KVPool.for_model(model.config, 32, "cpu", torch.float32), [(None, tokens)])
    assert torch.equal(on.hidden, off.hidden)


def test_not_under_tensor_parallel_nor_in_a_compiled_region(monkeypatch):
    monkeypatch.setattr(env, "NORM_FUSION", True)
    sharded = DenseLM(get_preset("tiny-dense"), TensorParallel(2, 0))  # structure only: no collective is run
    sharded.set_kernels("fused")
    assert not any(folds_post_attention_norm(layer) for layer in sharded.layers)  # an all-reduce follows the o proj
    single = _model()
    assert all(folds_post_attention_norm(layer) for layer in single.layers)
    assert not any(folds_post_attention_norm(layer, bcg_region=True) for layer in single.layers)
    monkeypatch.setattr(env, "NORM_FUSION", False)
    assert not any(folds_post_attention_norm(layer) for layer in single.layers)  # off by default


@pytest.mark.parametrize(("value", "expected"), [("", False), ("on", True), ("1", True), ("OFF", False), ("0", False)])
def test_the_norm_fusion_switches_are_read_once_and_checked(value, expected):
    """BCG_NORM_FUSION and BCG_INPUT_NORM_FUSION: unset is off (the H200 measured both slower); a value that is
    neither on nor off stops the import and says so."""
    code = "from bcg import env; print(env.NORM_FUSION, env.INPUT_NORM_FUSION)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BCG_NORM_FUSION": value, "BCG_INPUT_NORM_FUSION": value})
    assert run.returncode == 0 and run.stdout.split() == [str(expected)] * 2, run.stderr
    for name in ("BCG_NORM_FUSION", "BCG_INPUT_NORM_FUSION"):
        bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, name: "yes"})
        assert bad.returncode != 0 and f"{name}='yes': expected on or off (unset: off)" in bad.stderr
