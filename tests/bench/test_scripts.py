"""The runnable benchmark scripts run end to end on the CPU (their smoke mode) and print their JSON last."""

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


def test_host_path_smoke(tmp_path: Path) -> None:
    out = tmp_path / "hp"
    result = run_script("host_path.py", "--model", "tiny-dense", "--device", "cpu", "--tokens", "12",
                        "--requests", "3", "--runs", "2", "--calls", "5", "--out", str(out))
    assert result["tokens"] == 12 and result["replay"]["breaks"] == 2  # tiny-dense: two attention islands
    assert set(result["prefill"]) == {"1", "3"}
    assert all(t["wall_ms"] >= t["host_ms"] > 0 for row in result["prefill"].values() for t in row.values())
    assert (out / "host_path.json").exists() and "prefill" in (out / "profile_3req.txt").read_text()
