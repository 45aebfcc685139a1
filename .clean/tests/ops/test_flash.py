"""How flash_varlen picks its call path: the aten op where the probe agrees with varlen_attn, else varlen_attn; in
place where the build can (else one copy, which copy_reason names); never max_seqlen_q=1 with GQA; the reference on
the CPU.

The kernels need CUDA; here fakes stand in for them (the CPU's reference switched off) so the routing, the probe and
its fallbacks run on the CPU. The numerics of both paths are checked on the GPU (tests/ops/attention/test_island.py,
CUDA tier); the reference's in tests/ops/test_flash_reference.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bcg.ops import flash

CPU = torch.device("cpu")


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal):
    # Any deterministic function of the inputs will do: the probe only compares the two paths.
    return q * 2


class Calls:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.max_q: list[int] = []


@pytest.fixture
def fakes(monkeypatch):
    calls = Calls()

    def wrapper(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.names.append("wrapper")
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, True)

    def aten(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug):
        calls.names.append("aten")
        calls.max_q.append(max_q)
        assert dropout_p == 0.0 and debug is False
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal), None, None, None, None

    def aten_inplace(out, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug):
        calls.names.append("inplace")
        calls.max_q.append(max_q)
        out.copy_(_reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal))
        return None

    def wrapper_out(out, q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.names.append("wrapper_out")
        return out.copy_(_reference(q, k, v, cu_q, cu_k, max_q, max_k, True))

    monkeypatch.setattr(flash, "varlen_attn", wrapper)  # "this torch has varlen"
    monkeypatch.setattr(flash, "_FLASH", aten)
    monkeypatch.setattr(flash, "_FLASH_INPLACE", aten_inplace)
    monkeypatch.setattr(flash, "_ATEN_FLASH_OK", {})
    monkeypatch.setattr(flash, "FORCE_WRAPPER", False)
    monkeypatch.setattr(flash, "varlen_attn_out", None)  # torch 2.11's set: no public in-place API
    monkeypatch.setattr(flash, "REFERENCE_DEVICE_TYPES", frozenset())  # CPU tensors take the kernel's routes
    calls.wrapper_out = wrapper_out
    return calls


def _call(out=None, max_q=5, kv_heads=2):
    q = torch.randn(5, 4, 8)
    k = v = torch.randn(9, kv_heads, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    return q, flash.flash_varlen(q, k, v, cu, cu, max_q, 9, is_causal=True, out=out)


def test_direct_inplace_writes_into_out(fakes):
    out = torch.empty(5, 4, 8)
    q, result = _call(out)
    assert result is out and torch.equal(out, q * 2)  # written through the out buffer
    assert fakes.names[-1] == "inplace" and "wrapper" in fakes.names  # the probe compared against varlen_attn
    fakes.names.clear()
    _call(torch.empty(5, 4, 8))
    assert fakes.names == ["inplace"]  # probed once per device, then one call per island


def test_direct_without_out_or_inplace_op(fakes, monkeypatch):
    monkeypatch.setattr(flash, "_FLASH_INPLACE", None)
    out = torch.empty(5, 4, 8)
    _, result = _call(out)
    assert result is out and fakes.names[-1] == "aten"
    fakes.names.clear()
    _, result = _call()
    assert fakes.names == ["aten"] and result.shape == (5, 4, 8)


def test_copy_reason_names_what_the_build_lacks(fakes, monkeypatch):
    assert flash.copy_reason(CPU) is None  # the direct route writes in place
    monkeypatch.setattr(flash, "_FLASH_INPLACE", None)
    reason = flash.copy_reason(CPU)
    assert "_flash_attention_forward_no_dropout_inplace" in reason and "varlen_attn_out" in reason
    assert "one device-to-device copy per call" in reason
    monkeypatch.setattr(flash, "varlen_attn_out", fakes.wrapper_out)
    assert "varlen_attn_out" not in flash.copy_reason(CPU)  # the direct route is taken: only its op is missing
    monkeypatch.setattr(flash, "FORCE_WRAPPER", True)
    assert flash.copy_reason(CPU) is None  # the wrapper's route has varlen_attn_out
    assert flash.copy_reason(torch.device("cpu")) is None
    monkeypatch.setattr(flash, "REFERENCE_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(flash, "varlen_attn_out", None)
    assert flash.copy_reason(CPU) is None  # the reference writes in place


def test_the_wrapper_route_writes_in_place_through_varlen_attn_out(fakes, monkeypatch):
    monkeypatch.setattr(flash, "FORCE_WRAPPER", True)
    monkeypatch.setattr(flash, "varlen_attn_out", fakes.wrapper_out)
    out = torch.empty(5, 4, 8)
    q, result = _call(out)
    assert fakes.names == ["wrapper_out"] and result is out and torch.equal(out, q * 2)
    fakes.names.clear()
    _call()
    assert fakes.names == ["wrapper"]


@pytest.mark.parametrize(("max_q", "kv_heads", "passed"), [(1, 2, 2), (1, 4, 1), (3, 2, 3)])
def test_never_one_query_with_gqa(fakes, max_q, kv_heads, passed):
    """max_seqlen_q == 1 with more query than K/V heads sends FlashAttention-2 down a path that assumes every
    sequence has one query (an empty one breaks it): 2 is passed instead, an upper bound just as true."""
    _call(torch.empty(5, 4, 8), max_q=max_q, kv_heads=kv_heads)
    assert fakes.max_q[-1] == passed


def test_cpu_tensors_run_the_reference_without_varlen_attn(monkeypatch):
    monkeypatch.setattr(flash, "varlen_attn", None)
    q = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    kv = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 1], dtype=torch.int32)  # the serving soak's batch: one token, then an empty sequence
    out = torch.full_like(q, float("nan"))
    assert flash.flash_varlen(q[:1], kv[:1], kv[:1], cu, cu, 1, 1, is_causal=True, out=out[:1]) is not None
    assert torch.equal(out[0], kv[0].repeat_interleave(2, 0)) and out[1:].isnan().all()
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        flash.flash_varlen(q.float(), kv.float(), kv.float(), cu, cu, 1, 1, is_causal=True)
    assert flash.runs_flash_varlen(CPU, torch.bfloat16) and not flash.runs_flash_varlen(CPU, torch.float32)


def test_probe_mismatch_falls_back_to_varlen_attn_with_a_warning(fakes, monkeypatch, caplog):
    def wrong(q, *args):
        return torch.zeros_like(q), None, None, None, None

    monkeypatch.setattr(flash, "_FLASH", wrong)
    with caplog.at_level(logging.WARNING, logger="bcg.ops.flash"):
        assert flash.uses_aten_flash(CPU) is False
    assert "differs from varlen_attn" in caplog.text
    fakes.names.clear()
    out = torch.empty(5, 4, 8)
    q, result = _call(out)
    assert fakes.names == ["wrapper"] and torch.equal(result, out) and torch.equal(out, q * 2)


def test_probe_error_falls_back(fakes, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("schema mismatch\nmore")

    monkeypatch.setattr(flash, "_FLASH", broken)
    with caplog.at_level(logging.WARNING, logger="bcg.ops.flash"):
        assert flash.uses_aten_flash(CPU) is False
    assert "RuntimeError: schema mismatch" in caplog.text


def test_debug_switch_forces_the_wrapper(fakes, monkeypatch):
    _call(torch.empty(5, 4, 8))  # probed: the aten op is usable
    fakes.names.clear()
    monkeypatch.setattr(flash, "FORCE_WRAPPER", True)
    _call(torch.empty(5, 4, 8))
    assert fakes.names == ["wrapper"]


def test_debug_switch_is_read_from_the_environment():
    code = "from bcg.ops import flash; print(flash.FORCE_WRAPPER)"
    env = {**os.environ, "BCG_FLASH": "wrapper", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_no_varlen_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(flash, "varlen_attn", None)
    monkeypatch.setattr(flash, "REFERENCE_DEVICE_TYPES", frozenset())
    with pytest.raises(RuntimeError, match="varlen_attn is not available"):
        _call()
