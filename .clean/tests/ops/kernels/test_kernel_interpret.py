"""Runs the Triton kernels under Triton's interpreter on CPU (``interpret_kernels.py``) in a fresh process.

Triton chooses between compiling and interpreting when a kernel is decorated, and its own library functions are
decorated when ``triton`` is first imported (torch._dynamo imports it), so the interpreter has to be switched on
before anything imports Triton: this test starts a fresh ``pytest`` with ``TRITON_INTERPRET=1``. It needs
``triton`` importable, which torch's CPU wheels do not bring: the ``test`` extra installs it (``pip install -e
.[test]``, about 200 MB), and no GPU (there the CUDA tests run the compiled kernels).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from interpreter import run_under_interpreter

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: torch's CPU wheels do not bring it; pip install -e .[test] does")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernels")
@pytest.mark.interpreter(HERE / "interpret_kernels.py")  # started when the session is collected
def test_kernels_under_the_interpreter_in_a_fresh_process():
    run_under_interpreter(HERE / "interpret_kernels.py")
