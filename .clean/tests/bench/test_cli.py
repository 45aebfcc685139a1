"""`bcg bench` end to end on tiny-dense under the CPU emulation, and the flag errors of every command (`bcg analyze`'s
runs: test_analyze_cli.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from bcg.bench.config import AnalyzeConfig, BenchConfig, VerifyConfig
from bcg.cli import build_parser, main

FAST = ["--device", "cpu", "--runs", "1", "--warmup", "0", "--no-progress"]


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", *FAST, "--lengths", "8,16", "--batch-requests", "4", "--chunked-prefill-size", "64",
               "--out", str(tmp_path)])
    assert rc == 0
    captured = capsys.readouterr()
    out = captured.out
    banner = out.splitlines()[0]  # the emulation banner comes first, naming what runs
    assert banner.startswith("bcg bench: tiny-dense on the CPU") and "1 torch thread" in banner
    assert "native model code (--model-impl)" in banner and "tensor parallel size 1 (--tp)" in banner
    assert "not what graphs save on a GPU" in banner
    summary = last_json(out)
    assert summary["kind"] == "bench" and summary["emulated"] is True
    assert set(summary["geomean_speedup"]) == {"breakable"}  # eager over itself is no speedup
    assert "not the kernel-launch overhead" in summary["speedup_note"]
    geomean = next(line for line in out.splitlines() if line.startswith("Geomean speedup"))
    assert "CPU emulation" in geomean and "not the kernel-launch overhead" in geomean
    # Internal reason codes stay internal; the graph column says what happened in words.
    assert "backend_eager" not in out and "- (eager backend)" in out and "yes (bucket 16)" in out
    assert "\r" not in captured.err and "\x1b" not in captured.err  # no progress bars when stderr is no terminal

    data = json.loads((tmp_path / "results.json").read_text())
    assert {"schema", "config", "environment", "builds", "rows", "batch_rows", "memory", "plots"} <= set(data)
    keys = [(r["backend"], r["input_len"]) for r in data["rows"]]
    assert sorted(keys) == sorted({(b, n) for b in ("eager", "breakable") for n in (8, 16)})
    assert data["schema"] == "bcg.bench/3"
    for r in data["rows"]:  # the row layout bcg/bench/results.py documents
        assert set(r) == {"backend", "input_len", "num_requests", "num_tokens", "wall", "graph_used", "bucket",
                          "reason", "speedup", "device", "greedy"}
        w = r["wall"]
        assert w["median_ms"] > 0 and r["num_requests"] == 1 and w["runs"] == 1
        assert w["min_ms"] <= w["q1_ms"] <= w["median_ms"] <= w["q3_ms"] <= w["max_ms"]
        assert set(r["device"]) == {"ms", "host_ms", "wall_over_device", "floor_ms", "fused_floor_ms",
                                    "launch_gap_share"}
        assert all(v is None for v in r["device"].values())  # no device time on a CPU
    for r in data["rows"]:
        if r["backend"] == "breakable":
            assert r["speedup"]["low"] <= r["speedup"]["over_eager"] <= r["speedup"]["high"]
    assert data["config"]["threads"] == 1 and data["environment"]["torch_threads"] == 1
    assert all(r["graph_used"] for r in data["rows"] if r["backend"] == "breakable")
    assert all(r["greedy"]["equal_eager"] and len(r["greedy"]["next_tokens"]) == r["num_requests"]
               for r in data["rows"] + data["batch_rows"])
    assert all(r["speedup"]["over_eager"] == 1.0 for r in data["rows"] if r["backend"] == "eager")
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
    assert rc == 1  # the one backend asked for was measured nowhere: the README's "a run that measures nothing"
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert err.splitlines()[-1].startswith("bcg bench: error: no backend asked for could be measured, only the eager "
                                           "baseline (full: ValueError: backend 'full' is not available")
    assert "Unavailable (not measured, in no speedup):" in out and "  full: ValueError: backend 'full'" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["backend"] for r in data["rows"]] == ["eager"]
    assert data["memory"] is None and data["plots"] == []


@pytest.mark.parametrize("argv, message", [
    (["bench", "--backends", "eager,warp"], "argument --backends: unknown backend 'warp'"),
    (["bench", "--backends", ","], "argument --backends: empty; give e.g. eager,breakable"),
    (["bench", "--lengths", ""], "argument --lengths: empty; give a comma-separated list"),
    (["bench", "--lengths", "16,abc"], "argument --lengths: 'abc' is not an integer"),
    (["bench", "--lengths", "16,-4"], "argument --lengths: -4 must be >= 1"),
    (["bench", "--lengths", "16,1000000", "--device", "cpu"], "--lengths: 1000000 is outside [1, 131072] tokens"),
    (["bench", "--model", "no-such-model", "--device", "cpu"],
     "--model 'no-such-model' is neither a preset nor a checkpoint folder (presets: tiny-dense, tiny-moe"),
    (["analyze", "--model", "no-such-model", "--device", "cpu"], "--model 'no-such-model' is neither a preset"),
    (["analyze", "--lengths-file", "/no/such/file", "--device", "cpu"], "--lengths-file '/no/such/file': No such"),
    (["bench", "--runs", "0", "--device", "cpu"], "--runs must be >= 1, got 0"),
    (["analyze", "--warmup", "-1", "--device", "cpu"], "--warmup must be >= 0, got -1"),
    (["bench", "--threads", "0", "--device", "cpu"], "--threads must be >= 1, got 0"),
    (["bench", "--device", "tpu"], "--device 'tpu'"),
    (["bench", "--device", "cuda:99"], "--device 'cuda:99'"),
    (["bench", "--chunked-prefill-size", "100000", "--device", "cpu"],
     "--chunked-prefill-size must be in [1, 16384], got 100000"),
    (["analyze", "--length", "0", "--device", "cpu"], "--length must be in [1, 256]"),
    (["analyze", "--length", "300", "--device", "cpu"], "so at most --max-tokens 256), got 300"),
    (["analyze", "--max-tokens", "100000", "--device", "cpu"],
     "--max-tokens must be in [1, 256] (no forward is larger than --chunked-prefill-size 256), got 100000"),
    (["analyze", "--max-tokens", "0", "--device", "cpu"], "--max-tokens must be in [1, 256]"),
    (["analyze", "--num-prompts", "0", "--device", "cpu"], "--num-prompts must be in [1, 1000000], got 0"),
])
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: bcg" in err
    error = next(line for line in err.splitlines() if "error:" in line)
    body = error.split("error: ", 1)[1]
    if body.startswith("argument "):  # argparse names the flag; the message must not name it again
        flag, rest = body[len("argument "):].split(": ", 1)
        assert flag not in rest, error


def test_flags_map_one_to_one_to_config_fields() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, cls in (("bench", BenchConfig), ("analyze", AnalyzeConfig), ("verify", VerifyConfig)):
        dests = {a.dest for a in subparsers.choices[name]._actions if a.dest != "help"}
        assert dests == {f.name for f in fields(cls)}


def test_python_dash_m_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "bcg", "bench", "--model", "nope", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--model 'nope' is neither a preset nor a checkpoint folder" in proc.stderr


def test_refused_backend_is_unavailable_and_in_no_speedup(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # A real refusal: Inductor's CPU kernels cannot run under the CPU emulation, so tc_piecewise refuses the model.
    rc = main(["bench", *FAST, "--model", "tiny-moe", "--backends", "eager,breakable,tc_piecewise", "--tc-compiler",
               "inductor", "--lengths", "8", "--batch-requests", "2", "--no-memory", "--no-plots", "--out",
               str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("bcg bench: tiny-moe on the CPU")  # the banner names --model
    summary = last_json(out)
    assert "tc_compiler='traced'" in summary["unavailable"]["tc_piecewise"]
    assert set(summary["geomean_speedup"]) == {"breakable"}
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(r["backend"] != "tc_piecewise" for r in data["rows"] + data["batch_rows"])
    build = {b["backend"]: b for b in data["builds"]}["tc_piecewise"]
    assert build["available"] is False and build["refused_reason"] == build["error"]
    assert "tc_piecewise  refused" in out and "  tc_piecewise: backend 'tc_piecewise' cannot capture" in out


def test_many_request_rows_of_full_say_why_they_ran_eagerly(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", *FAST, "--backends", "eager,full", "--lengths", "8", "--batch-requests", "4",
               "--chunked-prefill-size", "64", "--no-memory", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    full = [r for r in data["batch_rows"] if r["backend"] == "full"]
    assert len(full) == 1 and full[0]["num_requests"] == 4  # one request slot at this chunk size
    assert full[0]["graph_used"] is False and full[0]["reason"] == "too_many_requests"
    assert "no: more requests than the graph's request slots" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import bcg

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"bcg {bcg.__version__} (distribution bcg-prefill; torch ")


def test_help_shows_defaults_and_presets(capsys: pytest.CaptureFixture[str]) -> None:
    from bcg.models.config import PRESETS

    for command in ("bench", "analyze", "verify"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        for default in ("(default: 0)", "2048 on CUDA, 256 on the CPU, for every command alike",
                        "on when stderr is a terminal", "(default: auto)"):
            assert default in text, (command, default)
        if command != "verify":  # analyze times fewer runs than bench by default
            runs, warmup = (10, 3) if command == "analyze" else (20, 5)
            assert all(d in text for d in (f"(default: {runs})", f"(default: {warmup})", "1 on the CPU")), command
        assert all(name in text for name in PRESETS)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 16)" in text and "eager,breakable on the CPU" in text


def test_every_flag_says_its_default() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest not in ("help", "parser", "func", "config"):
                assert "default" in (action.help or ""), (name, action.option_strings)


def test_progress_defaults_to_whether_stderr_is_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert BenchConfig(device="cpu").resolved().progress is False
    assert AnalyzeConfig(device="cpu", progress=True).resolved().progress is True
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert BenchConfig(device="cpu").resolved().progress is True
    assert BenchConfig(device="cpu", progress=False).resolved().progress is False


def test_bench_measures_variants_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", *FAST, "--backends", "breakable+fused,breakable+traced", "--lengths", "8",
               "--batch-requests", "1", "--no-memory", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["backend"] for r in data["rows"]] == ["eager", "breakable+fused", "breakable+traced"]
    builds = {b["backend"]: b for b in data["builds"]}
    assert builds["breakable+traced"]["compile_ms"] > 0 and builds["breakable+traced"]["available"]
    assert all(r["graph_used"] for r in data["rows"] if r["backend"] != "eager")
    # one table, with the kernels and the compiler of each row
    assert "kernels" in out and "compile" in out and "traced" in out and "fused" in out


def _bench_on_rank(out: str) -> dict:
    import contextlib
    import io
    import os

    rank_out = Path(out) / f"rank{os.environ['RANK']}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["bench", *FAST, "--tp", "2", "--lengths", "8,16", "--batch-requests", "1", "--no-memory",
                   "--no-plots", "--chunked-prefill-size", "16", "--out", str(rank_out)])
    files = sorted(p.name for p in rank_out.iterdir()) if rank_out.exists() else []
    return {"rc": rc, "stdout": printed.getvalue(), "files": files}


def test_bench_under_tensor_parallel_reports_from_rank_zero_only(tmp_path: Path) -> None:
    from rank_pool import RankPool

    pool = RankPool(2, timeout_s=120)
    try:
        zero, one = pool.run(_bench_on_rank, str(tmp_path))
    finally:
        pool.close()
    assert zero["rc"] == one["rc"] == 0
    assert one["stdout"] == "" and one["files"] == []  # every rank measured; only rank 0 printed and wrote
    assert zero["files"] == ["results.json"]
    summary = last_json(zero["stdout"])
    assert summary["tp"] == 2 and set(summary["geomean_speedup"]) == {"breakable"}
    data = json.loads((tmp_path / "rank0" / "results.json").read_text())
    assert data["config"]["tp"] == 2
    assert all(r["graph_used"] for r in data["rows"] if r["backend"] == "breakable")
