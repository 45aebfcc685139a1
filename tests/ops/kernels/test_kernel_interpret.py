"""Runs the Triton kernels under Triton's interpreter on CPU (``interpret_kernels.py``) in a fresh process.

Triton chooses between compiling and interpreting when a kernel is decorated, and its own library functions are
decorated when ``triton`` is first imported (torch._dynamo imports it), so the interpreter has to be switched on
before anything imports Triton: this test starts a fresh ``pytest`` with ``TRITON_INTERPRET=1``. It needs
``triton`` importable, which torch's CPU wheels do not bring: the ``test`` extra installs it (``pip install -e
.[test]``, about 200 MB), and no GPU (there the CUDA tests run the compiled kernels).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: torch's CPU wheels do not bring it; pip install -e .[test] does")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run the compiled kernels")
def test_kernels_under_the_interpreter_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "interpret_kernels.py")]
    result = subprocess.run(cmd, cwd=HERE.parents[2], env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary, summary
