"""How flash_varlen picks its call path: the aten op where the probe agrees with varlen_attn, else varlen_attn.

The kernels need CUDA; here fakes stand in for them so the routing, the probe and its fallbacks run on the CPU.
The numerics of both paths are checked on the GPU (tests/runtime/test_attention.py, CUDA tier).
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


@pytest.fixture
def fakes(monkeypatch):
    calls = Calls()

    def wrapper(q, k, v, cu_q, cu_k, max_q, max_k, is_causal):
        calls.names.append("wrapper")
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal)

    def aten(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug):
        calls.names.append("aten")
        assert dropout_p == 0.0 and debug is False
        return _reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal), None, None, None, None

    def aten_inplace(out, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug):
        calls.names.append("inplace")
        out.copy_(_reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal))
        return None

    monkeypatch.setattr(flash, "varlen_attn", object())  # "this torch has varlen"
    monkeypatch.setattr(flash, "_wrapper", wrapper)
    monkeypatch.setattr(flash, "_FLASH", aten)
    monkeypatch.setattr(flash, "_FLASH_INPLACE", aten_inplace)
    monkeypatch.setattr(flash, "_ATEN_FLASH_OK", {})
    monkeypatch.setattr(flash, "FORCE_WRAPPER", False)
    return calls


def _call(out=None):
    q = torch.randn(5, 4, 8)
    k = v = torch.randn(9, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    return q, flash.flash_varlen(q, k, v, cu, cu, 5, 9, is_causal=True, out=out)


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
    with pytest.raises(RuntimeError, match="varlen_attn is not available"):
        _call()
