"""Random interleavings in CI: a few seconds of benchmarks/serve_interleave.py (submit, prefill, recapture,
enable_bucket, cancel and close from caller threads and done-callbacks), every answer against a lone eager prefill,
no hang (the script dumps the stacks and exits at the first wait past --hang-s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_random_interleavings_answer_as_eager_and_never_hang() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_interleave.py"), "--quick",
                           "--hang-s", "60", "--seed", "3"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["hangs"] == 0 and result.get("mismatches", 0) == 0 and not result["errors"]
    assert result["rounds"] >= 2 and result["answered"] > 0 and result["prefills"] > 0
    assert result.get("recaptures", 0) + result.get("enables", 0) > 0 and result.get("actions_from_callback", 0) > 0
