"""`bcg bench` and `bcg analyze` end to end on tiny-dense under the CPU emulation, and flag errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from bcg.bench.config import AnalyzeConfig, BenchConfig
from bcg.cli import build_parser, main

FAST = ["--device", "cpu", "--runs", "1", "--warmup", "0", "--no-progress"]


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", *FAST, "--lengths", "8,16", "--batch-requests", "4", "--chunked-prefill-size", "64",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "CPU timings" in out.splitlines()[0]  # the emulation banner comes first
    summary = last_json(out)
    assert summary["kind"] == "bench" and summary["emulated"] is True
    assert set(summary["geomean_speedup"]) == {"eager", "breakable"}

    data = json.loads((tmp_path / "results.json").read_text())
    assert {"schema", "config", "environment", "builds", "rows", "batch_rows", "memory", "plots"} <= set(data)
    keys = [(r["backend"], r["input_len"]) for r in data["rows"]]
    assert sorted(keys) == sorted({(b, n) for b in ("eager", "breakable") for n in (8, 16)})
    for r in data["rows"]:
        for field in ("median_ms", "speedup_vs_eager", "kernel_floor_ms", "num_tokens", "graph_used", "reason"):
            assert field in r
        assert r["median_ms"] > 0 and r["num_requests"] == 1
    assert all(r["graph_used"] for r in data["rows"] if r["backend"] == "breakable")
    assert all(r["speedup_vs_eager"] == 1.0 for r in data["rows"] if r["backend"] == "eager")
    assert {(r["backend"], r["num_requests"]) for r in data["batch_rows"]} == {("eager", 4), ("breakable", 4)}
    build = {b["backend"]: b for b in data["builds"]}
    assert build["breakable"]["num_captured"] > 0 and build["breakable"]["ceiling"] == 16
    assert build["breakable"]["num_breaks"] >= 1  # attention islands
    assert data["memory"]["available"] is False and "CUDA" in data["memory"]["note"]
    for png in ("latency.png", "speedup.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert not (tmp_path / "memory.png").exists()


def test_bench_reports_unavailable_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import bcg.runtime.backends as backends

    real = backends.backend_class

    def fake(name):  # a backend whose construction raises, like one not written yet
        if name == "full":
            raise ValueError("backend 'full' is not available in this build")
        return real(name)

    monkeypatch.setattr("bcg.runtime.runner.runner.backend_class", fake)
    rc = main(["bench", *FAST, "--backends", "eager,full", "--lengths", "8", "--batch-requests", "1",
               "--no-memory", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    summary = last_json(capsys.readouterr().out)
    assert "not available" in summary["unavailable"]["full"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["backend"] for r in data["rows"]] == ["eager"]
    assert data["memory"] is None and data["plots"] == []


def test_analyze_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["analyze", *FAST, "--chunked-prefill-size", "32", "--length", "16", "--lengths", "5,12,30,70",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Verdict:" in out
    summary = last_json(out)
    assert summary["kind"] == "analyze" and 0.0 < summary["p"] <= 1.0
    assert summary["s_max"] == pytest.approx(1 / summary["p"])
    assert summary["pays"] is None  # CPU timings cannot judge launch overhead
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"timing", "replay", "amdahl", "coverage", "memory", "verdict", "model", "build"} <= set(data)
    assert data["replay"]["bucket"] == 16 and data["replay"]["islands"][0]["name"].endswith("attention")
    assert data["replay"]["islands"][0]["count"] == 2  # one attention island per layer of tiny-dense
    assert data["replay"]["replay_host_ms"] > 0 and data["replay"]["host_over_device"] > 0
    cov = data["coverage"]
    assert cov["num_forwards"] == 6  # 70 splits into 32 + 32 + 6
    assert cov["reaches_chunk"] is True and cov["max_bucket"] == 32
    assert cov["recommended_ceiling"] == 32
    assert isinstance(cov["never_fired"], list)
    assert data["amdahl"]["prediction_error"] is not None
    assert (tmp_path / "analyze.png").stat().st_size > 1000


def test_analyze_lengths_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "lengths.txt"
    f.write_text("4, 8  # short\n12\n")
    rc = main(["analyze", *FAST, "--chunked-prefill-size", "16", "--length", "8", "--lengths-file", str(f),
               "--no-plots", "--out", str(tmp_path / "out")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["coverage"]["num_prompts"] == 3


@pytest.mark.parametrize("argv, message", [
    (["bench", "--backends", "eager,warp"], "unknown backend 'warp'"),
    (["bench", "--lengths", ""], "--lengths is empty"),
    (["bench", "--lengths", "16,abc"], "'abc' is not an integer"),
    (["bench", "--lengths", "16,-4"], "must be >= 1"),
    (["bench", "--model", "no-such-model", "--device", "cpu"], "unknown model 'no-such-model'"),
    (["analyze", "--model", "no-such-model", "--device", "cpu"], "unknown model 'no-such-model'"),
    (["analyze", "--lengths-file", "/no/such/file", "--device", "cpu"], "--lengths-file"),
    (["bench", "--runs", "0", "--device", "cpu"], "--runs must be >= 1"),
    (["bench", "--device", "tpu"], "--device"),
])
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: bcg" in err


def test_flags_map_one_to_one_to_config_fields() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, cls in (("bench", BenchConfig), ("analyze", AnalyzeConfig)):
        dests = {a.dest for a in subparsers.choices[name]._actions if a.dest != "help"}
        assert dests == {f.name for f in fields(cls)}


def test_python_dash_m_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "bcg", "bench", "--model", "nope", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown model 'nope'" in proc.stderr
