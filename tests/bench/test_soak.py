"""benchmarks/soak.py end to end on the CPU: random prefills with injected island failures, all equal to eager."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_soak_smoke() -> None:
    result = run_script("soak.py", "--prefills", "40", "--presets", "tiny-dense", "--failure-rate", "0.2",
                        "--warmup", "10", "--sample-every", "10", "--threads", "2")
    stats = result["stats"]["tiny-dense"]
    assert result["ok"] and stats["prefills"] == 40 and stats["mismatches"] == 0 and stats["pool_leaks"] == 0
    assert stats["injected"] > 0 and stats["failed_replays"] > 0  # faults happened, and were survived
    assert stats["replay_failures_recorded"] == stats["failed_replays"]
    assert len(result["memory"]) >= 2
