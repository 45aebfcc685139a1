"""Runs a file of Triton kernel checks under Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh process: the
interpreter is chosen when triton is imported, so it cannot be switched on inside this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(path: Path, allow_skips: bool = True) -> None:
    """Runs pytest on ``path`` with ``TRITON_INTERPRET=1``; fails with its output unless every check passed (and
    none skipped, where ``allow_skips`` is False)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary, summary
    assert allow_skips or "skipped" not in summary, summary
