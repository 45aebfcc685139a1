"""`bcg analyze` end to end on tiny-dense under the CPU emulation: predicting captures and compiles nothing of the
model, the report and the JSON, --validate beside the predictions, --cpu-cores restoring the process, workload files
and budgets, and the flags it refuses. The numbers are the emulation's: only structure and arithmetic are checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bcg.cli import main

FAST = ["--device", "cpu", "--runs", "2", "--warmup", "0", "--no-progress", "--chunked-prefill-size", "32",
        "--predict-lengths", "8,16", "--length", "16"]
VARIANTS = {"breakable", "full", "tc_piecewise"}  # the CPU default


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_predicting_captures_and_compiles_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.runtime.backends.tc_piecewise import TcPiecewiseBackend
    from bcg.runtime.runner.build import GraphBuilder

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("bcg analyze captured or compiled the model without --validate")

    for owner, name in ((GraphBuilder, "capture"), (GraphBuilder, "_compile"), (TcPiecewiseBackend, "prepare")):
        monkeypatch.setattr(owner, name, refuse)
    rc = main(["analyze", *FAST, "--lengths", "5,12,30,70", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    summary = last_json(out)
    assert set(summary["predictions"]) == {"eager", *VARIANTS}
    assert all(set(ms) == {"8", "16"} for ms in summary["predictions"].values())
    assert summary["intervals"].keys() == summary["predictions"].keys()
    for v, by_len in summary["predictions"].items():  # each prediction inside its interval
        for n, ms in by_len.items():
            low, high = summary["intervals"][v][n]
            assert low <= ms <= high, (v, n)
    parts = summary["timings"]["parts_s"]
    assert {"machine", "host times", "profiles", "composition"} <= set(parts) and all(s >= 0 for s in parts.values())
    for n, r in summary["timings"]["repeats"]["eager"].items():  # --runs 2: two runs each; two or three profiles
        assert r["host_runs"] == 2 and r["profiles"] in (2, 3), n
    rec = summary["recommendation"]
    assert set(rec) == {"backend", "ceiling", "buckets"} and rec["backend"] in {"eager", *VARIANTS}
    assert "measured" not in summary and "errors" not in summary and summary["pays"] is None
    for words in ("1. launch-gap share", "2. dynamic share p", "3. bucket coverage against chunked_prefill_size",
                  "4. resident graph memory", "nothing captured", "Islands at 16 tokens", "attention_island",
                  "Recommendation:", "Verdict: CPU emulation", "mean nothing for a GPU", "interval",
                  "Predicting took", "profiles"):
        assert words in out, words
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema"] == "bcg.analyze/2" and data["config"]["validate"] is False
    assert data["parameters"]["bucket_coverage"]["num_forwards"] == 6  # 70 splits into 32 + 32 + 6
    assert data["forecasts"]["breakable"]["graph"] == {"8": True, "16": True}
    assert data["machine"]["None"]["emulated"] is True and data["timings"]["validate_s"] is None
    assert data["recommendation"]["buckets"] == rec["buckets"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["amdahl.png", "analyze.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in ("amdahl.png", "analyze.png"))


def test_validate_and_cpu_cores_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cores = [1, 2] if len(os.sched_getaffinity(0)) >= 2 else [1]
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    rc = main(["analyze", *FAST, "--lengths", "5,30", "--validate", "--cpu-cores", ",".join(map(str, cores)),
               "--out", str(tmp_path)])
    assert rc == 0
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads  # the process as it was
    out = capsys.readouterr().out
    summary = last_json(out)
    # the last line: predictions with their intervals, the recommendation, and what was measured with the errors
    assert summary["intervals"].keys() == summary["predictions"].keys()
    assert set(summary["recommendation"]) == {"backend", "ceiling", "buckets"}
    for v in VARIANTS:  # every variant runs under the emulation, so each is measured and has errors
        assert summary["errors"][v].keys() == summary["predictions"][v].keys() == summary["measured"][v].keys()
        assert summary["intervals"][v].keys() == summary["predictions"][v].keys()
        assert all(ms > 0 for ms in summary["measured"][v].values())
        for n, err in summary["errors"][v].items():
            assert err == pytest.approx(summary["predictions"][v][n] / summary["measured"][v][n] - 1)
    assert "predicted before capture, then measured (--validate)" in out and "error" in out
    assert "The host as a variable" in out and "Measured replay of breakable, bucket 16" in out
    assert "Measured replay of breakable, bucket 8" in out  # the shortest length's too (5 tokens: bucket 8)
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["cpu_cores"]) == {str(k) for k in cores}
    for k in cores:  # the host's costs per core count; the device's are the same for all
        machine = data["machine"][str(k)]
        assert machine["eager_launch_us"] > 0
        assert (machine["tiny_kernel_us"], machine["medium_kernel_us"]) == (
            data["machine"]["None"]["tiny_kernel_us"], data["machine"]["None"]["medium_kernel_us"])
    for row in data["cpu_cores"].values():
        assert VARIANTS <= set(row["predictions"]) and VARIANTS <= set(row["measured"])
        assert row["fallbacks"] == {}  # tc_piecewise rebuilt per core count replays there (no eager fallback)
        assert 0.0 <= row["launch_gap_share"] <= 1.0
    assert all(data["validation"][v]["fallbacks"] == {} for v in VARIANTS)
    breakable = data["validation"]["breakable"]
    assert breakable["available"] and breakable["predicted_available"] and breakable["replay"]["bucket"] == 16
    assert breakable["replay_short"]["bucket"] == 8 and breakable["replay_short"]["replay_host_ms"] > 0
    assert data["validation"]["full"]["replay"] is None  # the step-by-step replay is the breakable backends' own
    assert data["timings"]["validate_s"] > 0 and data["amdahl"]["measured_speedup"] > 0
    assert set(data["measured_expected_ms"]) == {"eager", *VARIANTS}
    assert (tmp_path / "cpu_cores.png").stat().st_size > 1000
    capsys.readouterr()
    assert _targets(str(tmp_path / "results.json")) == 0  # the GPU run's target check reads this file
    targets = last_json(capsys.readouterr().out)["models"][0]
    assert targets["model"] == "tiny-dense" and targets["recommended"] == data["recommendation"]["backend"]
    assert targets["fastest_measured"] in data["measured_expected_ms"] and 0 < targets["predict_share"] < 1


def _targets(*argv: str) -> int:
    import sys

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        from analyze_targets import main as targets
    finally:
        sys.path.pop(0)
    return targets(list(argv))


def test_the_target_check_judges_a_recommendation_among_what_fits_the_budget_measured() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from analyze_targets import check
    finally:
        sys.path.pop(0)
    mib = 2**20

    def result(backend: str, budget: float, ceiling: int = 2048) -> dict:
        return {"model": {"name": "m"}, "environment": {}, "config": {"max_tokens": 2048},
                "timings": {"predict_s": 3.0, "validate_s": 30.0},
                "recommendation": {"backend": backend, "ceiling": ceiling, "memory_budget_bytes": budget},
                "errors": {}, "measured": {}, "predictions": {},
                "measured_expected_ms": {"fast": 1.0, "slow": 1.5, "eager": 9.0},
                "validation": {v: {"available": True, "predicted_available": True, "graph_memory_bytes": m}
                               for v, m in (("fast", 300 * mib), ("slow", 100 * mib), ("eager", None))}}

    # no budget in the way: the fastest is right, the slower one 50% behind
    assert check(result("fast", 1024 * mib))["recommendation_ok"] is True
    assert check(result("slow", 1024 * mib))["recommendation_ok"] is False
    # "fast" measured over a 200 MiB budget: the fastest that fits is "slow", and recommending "fast" is wrong
    over = check(result("fast", 200 * mib))
    assert over["fits_budget_measured"] == {"fast": False, "slow": True, "eager": None}
    assert over["fastest_measured"] == "slow" and over["recommendation_ok"] is False
    assert check(result("slow", 200 * mib))["recommendation_ok"] is True
    # capped below the ladder the validation built, its full ladder's memory says nothing of the recommendation
    assert check(result("fast", 200 * mib, ceiling=512))["fits_budget_measured"]["fast"] is None


def test_workload_trace_and_a_budget_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_len": 12, "output_len": 1}\n{"prompt_token_ids": [1, 2, 3, 4, 5]}\n')
    rc = main(["analyze", *FAST, "--lengths-file", str(trace), "--memory-budget", "1KiB", "--no-plots",
               "--backends", "breakable,full", "--out", str(tmp_path / "out")])
    assert rc == 0
    summary = last_json(capsys.readouterr().out)
    assert summary["recommendation"] == {"backend": "eager", "ceiling": None, "buckets": []}
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["workload"] == {"source": f"--lengths-file {trace}", "num_prompts": 2, "lengths": [12, 5]}
    assert data["recommendation"]["memory_budget_bytes"] == 1024
    assert "fits the graph-memory budget" in data["recommendation"]["reason"]
    assert set(data["predictions"]) == {"eager", "breakable", "full"} and data["plots"] == []


@pytest.mark.parametrize("argv, message", [
    (["--predict-lengths", "64"], "--predict-lengths: 64 tokens is more than --chunked-prefill-size 32"),
    (["--cpu-cores", "4096"], "--cpu-cores: 4096 cores asked, but this process may run on"),
    (["--memory-budget", "lots"], "argument --memory-budget: 'lots' is not a size"),
    (["--backends", "eager"], "--backends names no graph backend"),
    (["--tc-compiler", "nvcc"], "argument --tc-compiler: invalid choice"),
    (["--lengths", "64,5000"], "--lengths: 5000 tokens is more than 'tiny-dense' holds (its context is 4096"),
])
def test_bad_analyze_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["analyze", *FAST, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: bcg analyze" in err


def test_a_lengths_file_past_the_models_context_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_len": 12}\n{"input_len": 100000}\n')
    with pytest.raises(SystemExit) as exc:
        main(["analyze", *FAST, "--lengths-file", str(trace), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lengths-file: 100000 tokens is more than 'tiny-dense' holds (its context is 4096 tokens" in err
    assert not (tmp_path / "out").exists()
