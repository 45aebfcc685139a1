"""The CUDA tier of `bcg bench`: every row's own device time and the host overhead above it, and the floors (`bcg
analyze`'s CUDA tier: test_analyze_cuda.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bcg.cli import main

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAST = ["--device", "cuda", "--model", "tiny-dense", "--runs", "3", "--warmup", "1", "--no-progress", "--no-plots"]


def test_every_bench_row_has_its_variants_device_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", *FAST, "--backends", "eager,breakable,breakable+fused", "--lengths", "16,64",
               "--batch-requests", "2", "--no-memory", "--chunked-prefill-size", "64", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "device ms" in out and "host ms" in out and "wall/device" in out
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"] + data["batch_rows"]
    assert {r["backend"] for r in rows} == {"eager", "breakable", "breakable+fused"} and len(rows) == 12
    for r in rows:
        d, wall = r["device"], r["wall"]["median_ms"]
        assert d["ms"] > 0 and d["floor_ms"] > 0 and d["fused_floor_ms"] > 0, r
        assert d["host_ms"] == pytest.approx(wall - d["ms"]) and d["wall_over_device"] == pytest.approx(wall / d["ms"])
        if r["backend"] == "eager":
            assert d["ms"] == d["floor_ms"]  # eager's own device time is the floor
        else:
            assert r["graph_used"]
