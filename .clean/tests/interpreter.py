"""Runs a file of Triton kernel checks under Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh process: the
interpreter is chosen when triton is imported, so it cannot be switched on inside this one.

The interpreter takes minutes of one core, and the test session mostly one core of its own: so the session starts
every selected test's file at collection (``tests/conftest.py``, through :func:`start_in_background`), one after
another on a background thread, and each test waits for its own file's run when it gets to it.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Run:
    cmd: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    process: subprocess.Popen | None = None
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""

    def start(self) -> None:
        # One thread for the interpreter: the session's own tests run beside it on the other cores.
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
        try:
            self.process = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
            try:
                self.stdout, self.stderr = self.process.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.stdout, self.stderr = self.process.communicate()
                self.stderr += "\n(killed after 900 s)"
            self.returncode = self.process.returncode
        except OSError as e:
            self.returncode, self.stderr = -1, f"could not start it: {e}"
        finally:
            self.done.set()


_runs: dict[Path, _Run] = {}


def _command(path: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]


def start_in_background(paths: list[Path]) -> None:
    """Runs each of ``paths`` under the interpreter, one after another, on a background thread."""
    runs = [_runs.setdefault(p, _Run(_command(p))) for p in dict.fromkeys(paths) if p not in _runs]
    if runs:
        threading.Thread(target=lambda: [r.start() for r in runs], name="bcg-interpreter", daemon=True).start()


@atexit.register
def _stop_left_over() -> None:  # a session that ends early (-x, Ctrl-C) leaves no interpreter running
    for run in _runs.values():
        if run.process is not None and run.process.poll() is None:
            run.process.kill()


def run_under_interpreter(path: Path, allow_skips: bool = True) -> None:
    """Runs pytest on ``path`` with ``TRITON_INTERPRET=1`` (or waits for the run started at collection); fails with
    its output unless every check passed (and none skipped, where ``allow_skips`` is False)."""
    run = _runs.pop(path, None)
    if run is None:
        run = _Run(_command(path))
        run.start()
    run.done.wait()
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"{' '.join(run.cmd)} failed:\n{run.stdout[-8000:]}\n{run.stderr[-3000:]}"
    assert " passed" in summary, summary
    assert allow_skips or "skipped" not in summary, summary
