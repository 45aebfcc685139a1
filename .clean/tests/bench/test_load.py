"""`bcg load` end to end on tiny-dense (CPU smoke runs of a second or less), its workload, its figure and its misuse
(one line, exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bcg.bench.load_config import LoadConfig
from bcg.bench.load_report import load_figure
from bcg.bench.workload import make_workload, parse_lengths, read_trace
from bcg.cli import main

FAST = ["load", "--device", "cpu", "--no-progress", "--warmup", "2", "--chunked-prefill-size", "64"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    code = main(argv)
    out = capsys.readouterr().out
    return code, json.loads(out.strip().splitlines()[-1]), out


def test_two_backends_side_by_side_with_a_shared_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary, out = run([*FAST, "--backends", "eager,breakable", "--rates", "20,60", "--duration", "0.5",
                              "--lengths", "fixed:10", "--shared-prefix", "40", "--out", str(tmp_path)], capsys)
    assert code == 0 and summary["kind"] == "load" and summary["emulated"]
    assert "CPU smoke test" in out.splitlines()[0] and "CPU smoke test" in summary["note"]
    assert set(summary["rates"]) == {"eager", "breakable"} and set(summary["rates"]["breakable"]) == {"20", "60"}
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["schema"] == "bcg.load/1" and summary["plots"] == [str(tmp_path / "load.png")]
    assert (tmp_path / "load.png").stat().st_size > 0
    rows = results["rows"]
    assert [(r["backend"], r["rate"]) for r in rows] == [("eager", 20), ("eager", 60), ("breakable", 20),
                                                         ("breakable", 60)]
    for r in rows:
        assert r["completed"] == r["submitted"] > 0 and not r["fell_behind"] and r["failed"] == 0
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"] <= r["ttft_ms"]["max"]
        assert r["cached_share"] > 0.5  # 40 of every 50 tokens are the shared prefix, cached after the first
        assert r["tokens_per_s"] > 0
    assert all(r["graph_share"] == 1.0 for r in rows if r["backend"] == "breakable")
    assert [w["requests"] for w in results["workload"]["per_rate"]] == [r["submitted"] for r in rows[:2]]
    assert "Time to first token under load" in out


def test_the_warm_up_runs_every_path_and_is_reported_apart_from_the_windows(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, out = run([*FAST, "--backends", "breakable", "--rates", "20", "--duration", "0.5", "--lengths",
                        "fixed:10", "--no-plots", "--out", str(tmp_path)], capsys)
    results = json.loads((tmp_path / "results.json").read_text())
    (warmup,) = results["warmups"]
    assert code == 0 and warmup["backend"] == "breakable" and warmup["requests"] == 2 and warmup["wall_ms"] > 0
    assert {f"graph {b}" for b in warmup["prefill_tokens"]} <= set(warmup["paths"])  # every bucket replayed once
    assert "breakable: warm-up before the measured windows: 2 requests" in out
    (row,) = results["rows"]
    assert row["cold_forwards"] == 0 and row["cold_ttft_ms_max"] is None  # nothing ran for the first time in it


def test_a_forward_on_a_path_new_to_the_window_is_counted_cold() -> None:
    from bcg.bench.load_run import measure_rate
    from bcg.bench.workload import make_workload, parse_lengths
    from bcg.runtime import Engine

    with Engine("tiny-dense", backend="breakable", device="cpu", buckets=[16, 32], chunked_prefill_size=64,
                seed=0, progress=False) as eng:
        work = make_workload(50.0, 0.2, parse_lengths("fixed:10"), 0, 256, seed=0)
        row = measure_rate(eng, work, "breakable", 5.0, seen=set())
        assert row.cold_forwards >= 1 and row.cold_ttft_ms_max is not None and row.completed
        seen = {"graph 16", "graph 32"}
        assert measure_rate(eng, work, "breakable", 5.0, seen=seen).cold_forwards == 0


def test_a_garbage_collection_inside_a_window_is_measured_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full collection holds every thread at once: the row says how long, and the text names it under the table
    (the ~180 ms submit() maximum on the H200 was one such pass over an unfrozen heap)."""
    import gc

    from bcg.bench import load_report, load_run
    from bcg.runtime import Engine

    real = load_run._submit_on_schedule

    def with_a_collection(*args, **kwargs):
        gc.collect()
        return real(*args, **kwargs)

    monkeypatch.setattr(load_run, "_submit_on_schedule", with_a_collection)
    with Engine("tiny-dense", backend="breakable", device="cpu", buckets=[16], chunked_prefill_size=16,
                progress=False) as eng:
        row = load_run.measure_rate(eng, make_workload(50.0, 0.1, parse_lengths("fixed:8"), 0, 256, seed=0),
                                    "breakable", 5.0)
    assert row.gc_full_collections >= 1 and row.gc_pause_ms_max > 0
    monkeypatch.setattr(load_report, "GC_PAUSE_NOTED_MS", 0.0)
    text = load_report.format_load([row], [])
    assert f"breakable at 50 req/s: the garbage collector held every thread for up to {row.gc_pause_ms_max:.1f} ms" \
        in text


def test_a_backend_that_falls_behind_stops_and_skips_its_higher_rates(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, summary, out = run([*FAST, "--backends", "breakable", "--rates", "20000,40000", "--duration", "0.5",
                              "--lengths", "fixed:60", "--max-wait", "0.05", "--no-plots", "--out", str(tmp_path)],
                             capsys)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert code == 0 and rows[0]["fell_behind"] and rows[1]["skipped"] and not rows[1]["submitted"]
    assert rows[0]["submitted"] < 0.9 * 20000 * 0.5  # it stopped submitting once it fell behind
    assert rows[0]["completed"] + rows[0]["unanswered"] == rows[0]["submitted"]
    assert "FELL BEHIND" in out and "skipped" in out and summary["plots"] == []
    assert list(summary["rates"]["breakable"]) == ["20000"] and summary["rates"]["breakable"]["20000"]["fell_behind"]


def test_a_trace_gives_the_arrivals_and_lengths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("# arrival_s length\n0.00 5\n0.01, 30\n0.02 7\n0.30 12  # a late one\n")
    code, summary, _ = run([*FAST, "--backends", "breakable", "--trace", str(trace), "--no-plots", "--out",
                            str(tmp_path / "out")], capsys)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert code == 0 and results["rows"][0]["submitted"] == results["rows"][0]["completed"] == 4
    assert results["workload"]["per_rate"][0]["tokens"] == 54


def test_ctrl_c_exits_130_and_stops_the_engine_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import bcg.bench.load_run as load

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(load, "measure_rate", interrupted)
    before = set(threading.enumerate())
    assert main([*FAST, "--backends", "breakable", "--rates", "5", "--duration", "0.2", "--out", str(tmp_path)]) == 130
    assert "bcg load: interrupted" in capsys.readouterr().err
    assert set(threading.enumerate()) <= before  # close() ran on the way out: no scheduler thread is left


def test_workloads_are_seeded_and_shaped_as_asked(tmp_path: Path) -> None:
    spec = parse_lengths("lognormal:180")
    assert (spec.low, spec.high) == (16, 4000)
    a = make_workload(200.0, 2.0, spec, 30, 256, seed=1)
    b = make_workload(200.0, 2.0, spec, 30, 256, seed=1)
    assert len(a.prompts) == len(b.prompts) and all((x == y).all() for x, y in zip(a.prompts, b.prompts))
    lengths = np.array([p.numel() - 30 for p in a.prompts])
    assert 300 < len(lengths) < 500 and lengths.min() >= 16 and lengths.max() <= 4000
    assert 120 < np.median(lengths) < 260  # median 180
    assert all((p[:30] == a.prompts[0][:30]).all() for p in a.prompts)  # the shared prefix
    assert np.all(np.diff(a.arrivals) >= 0) and a.arrivals[-1] <= 2.0
    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("7, 9\n11\n")
    assert set(parse_lengths(str(lengths_file)).sample(np.random.default_rng(0), 50).tolist()) == {7, 9, 11}
    assert parse_lengths("lognormal:50:10:60").high == 60


def test_the_figure_draws_from_the_json_rows() -> None:
    rows = [{"backend": b, "rate": r, "skipped": False, "fell_behind": r == 900, "tokens_per_s": r * 300.0,
             "ttft_ms": {"p50": 5.0 + r / 100, "p99": 9.0 + r / 50}} for b in ("eager", "breakable")
            for r in (100, 300, 900)]
    fig = load_figure(rows + [{"backend": "full", "rate": 100, "skipped": True, "ttft_ms": {}}], "t", "note")
    ax, ax2 = fig.axes
    assert len(ax2.get_lines()) == 2 and ax.get_yscale() == "log"


@pytest.mark.parametrize(("flags", "message"), [
    (["--lengths", "lognormal:abc"], "--lengths 'lognormal:abc'"),
    (["--lengths", "uniform:5"], "neither fixed:N, lognormal:MEDIAN[:MIN:MAX] nor a file"),
    (["--lengths", "fixed:4000", "--shared-prefix", "200"], "its context is 4096 tokens"),
    (["--rates", "0"], "--rates must be positive"),
    (["--rates", "fast"], "not a comma list of numbers"),
    (["--duration", "-1"], "--duration must be a positive number"),
    (["--max-wait", "0"], "--max-wait must be a positive number"),
    (["--shared-prefix", "-4"], "--shared-prefix must be >= 0"),
    (["--trace", "missing.txt"], "--trace 'missing.txt' cannot be read"),
    (["--trace", "x.txt", "--rates", "5"], "leave out --rates and --lengths"),
    (["--backends", "eager,warp"], "unknown backend 'warp'"),
])
def test_misuse_is_one_line_and_exit_status_2(flags: list[str], message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*FAST, *flags, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert message in err, err


def test_the_flags_the_user_gave_are_the_ones_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    for flags, message in ((["--lengths", str(tmp_path / "empty.jsonl")], "--lengths '"),
                           (["--lengths", "fixed:5000"], "--lengths: 5000 tokens is more than 'tiny-dense' holds")):
        with pytest.raises(SystemExit) as exc:
            main([*FAST, *flags, "--out", str(tmp_path)])
        line = capsys.readouterr().err.splitlines()[-1]
        assert exc.value.code == 2 and line.startswith(f"bcg load: error: {message}"), line
        assert "--lengths-file" not in line and "--shared-prefix" not in line  # flags load lacks, or not given


def test_a_trace_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("0.1 5\nsoon 7\n")
    with pytest.raises(ValueError, match="line 2: expected 'ARRIVAL_S LENGTH'"):
        read_trace(str(bad))
    with pytest.raises(ValueError, match="holds no requests"):
        (tmp_path / "empty.txt").write_text("# nothing\n")
        read_trace(str(tmp_path / "empty.txt"))
    assert LoadConfig(device="cpu").resolved().rates == [10.0, 40.0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_on_the_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary, out = run(["load", "--model", "tiny-dense", "--backends", "eager,breakable+fused", "--rates",
                              "50,200", "--duration", "1", "--lengths", "lognormal:48:8:256", "--shared-prefix", "64",
                              "--chunked-prefill-size", "512", "--no-progress", "--out", str(tmp_path)], capsys)
    assert code == 0 and not summary["emulated"] and summary["note"] is None and "smoke" not in out.splitlines()[0]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert all(r["completed"] == r["submitted"] > 0 and r["cached_share"] > 0.3 for r in rows)
    assert all(r["graph_share"] > 0.9 for r in rows if r["backend"] == "breakable+fused")


def test_the_target_checker_judges_load_results() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from load_targets import judge
    finally:
        sys.path.pop(0)

    def results(model: str, p99: float, tokens: float, shared: int = 0, p50: float = 10.0) -> dict:
        rows = [{"backend": "breakable+fused", "rate": rate, "skipped": False, "fell_behind": rate > 900,
                 "ttft_ms": {"p50": p50, "p99": p99}, "tokens_per_s": tokens * rate / 2000} for rate in (900, 2000)]
        return {"config": {"model": model, "shared_prefix": shared}, "rows": rows}

    lines, verdict = judge([results("llama-dense", 25.0, 320e3), results("gptoss-moe", 50.0, 300e3)],
                           results("llama-dense", 9, 1, 1000, p50=4.0), results("llama-dense", 9, 1, 1000, p50=15.0))
    assert verdict["llama-dense_p99_at_900"] and verdict["llama-dense_saturation"]
    assert verdict["gptoss-moe_p99_at_900"] is False and verdict["gptoss-moe_saturation"] is False  # 300k < 304k
    assert verdict["prefix_p50_ratio"] and verdict["prefix_ratios"] == {"900": 4 / 15, "2000": 4 / 15}
    assert any("p99 TTFT at 900 req/s 50.0 ms (target <= 45 ms): MISSED" in line for line in lines)
