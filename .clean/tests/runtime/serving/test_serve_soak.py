"""The serving soak's quick mode runs in CI: requests from several threads with shared prefixes, island and forward
failures injected, every answer against eager, no slot leaked; with SDPA islands, and with the varlen backend's
(FlashAttention's reference in bf16, the GPU's path: its one-token batches crashed the H200 soak)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ATTENTION = {"sdpa": [], "varlen": ["--attention-backend", "varlen", "--dtype", "bfloat16"]}


@pytest.mark.parametrize("attention", ATTENTION)
def test_serve_soak_quick(attention: str) -> None:
    soak = [sys.executable, str(ROOT / "benchmarks" / "serve_soak.py"), "--quick", *ATTENTION[attention]]
    proc = subprocess.run(soak, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    s = result["stats"]["tiny-dense"]
    assert s["attention_backend"] == attention and not s["buckets_not_captured"] and not s["client_errors"]
    assert result["ok"] and s["mismatches"] == 0 and s["pool_leak"] == 0 and s["slots_held_outside_cache"] == 0
    assert s["answered"] + s["failed"] + s["prefills"] == 240
    assert s["injected_island_failures"] > 0 and s["failed_replays"] > 0  # replays failed and were rerun eagerly
    assert s["injected_forward_failures"] > 0 and s["failed"] == s["requests_in_failed_forwards"] > 0
    assert s["cached_tokens"] > 0 and s["evicted_tokens"] > 0 and s["duplicates"] > 0
    assert len(result["memory"]) >= 2
