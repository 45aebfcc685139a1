"""Small pure helpers of bcg.bench: timing, tables/JSON, configs, the verdict, and the modules' doctests."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import re

import pytest

from bcg.bench import analyze, checks, results, tables, text, timing
from bcg.bench.config import AnalyzeConfig, BenchConfig
from bcg.bench.defaults import ANALYZE_RUNS, ANALYZE_WARMUP, RUNS, WARMUP
from bcg.bench.engines import BuildRecord, EngineSpec, split_tokens
from bcg.bench.latency import LatencyResult
from bcg.bench.memory import ceilings_for, run_memory
from bcg.bench.rows import CPU_SPEEDUP_NOTE, LatencyRow, TokenCheck, compare_with_eager, geomean_speedups
from bcg.bench.timing import Stats


@pytest.mark.parametrize("name", ["amdahl", "tables", "results", "text", "timing", "config", "config_base", "checks",
                                  "engines", "memory", "analyze"])
def test_doctests(name: str) -> None:
    mod = importlib.import_module(f"bcg.bench.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_time_fn_and_marks_on_cpu() -> None:
    calls = []
    t = timing.time_fn(lambda: calls.append(1), "cpu", runs=4, warmup=2)
    assert len(calls) == 6 and t.runs == 4 and t.min_ms <= t.median_ms
    marks = timing.Marks("cpu")
    for _ in range(3):
        marks.mark()
    assert len(marks.deltas_ms()) == 2
    assert timing.gpu_kernel_ms(lambda: None, "cpu") is None
    with pytest.raises(ValueError):
        timing.time_fn(lambda: None, "cpu", runs=0)


def test_union_of_kernel_intervals_counts_overlap_once() -> None:
    assert timing._union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert timing._union_ms([]) == 0.0


def test_table_aligns_numbers_right() -> None:
    lines = tables.table(["name", "ms"], [["a", "1.5"], ["long name", "10.25"]]).splitlines()
    assert lines[2].endswith(" 1.5") and lines[3].endswith("10.25")
    assert len({len(line) for line in lines[1:]}) == 1


def test_json_has_no_nan_or_inf(tmp_path) -> None:
    path = results.write_json(tmp_path / "x" / "r.json", {"a": math.inf, "b": [math.nan, 1.0]})
    assert json.loads(path.read_text()) == {"a": None, "b": [None, 1.0]}


def test_split_tokens_and_ceilings() -> None:
    assert split_tokens(64, 16) == [4] * 16
    assert sum(split_tokens(100, 16)) == 100 and max(split_tokens(100, 16)) - min(split_tokens(100, 16)) <= 1
    assert [c for _, _, c in ceilings_for(4)] == [None, 1, 2, 4]
    assert [c for _, _, c in ceilings_for(2)] == [None, 1, 2]  # 1/4 of 2 rounds to 0 and is dropped


def test_memory_on_cpu_is_none_with_a_note() -> None:
    from bcg.runtime.config import EngineConfig

    res = run_memory(EngineSpec("tiny-dense", EngineConfig(device="cpu", chunked_prefill_size=64, progress=False)))
    assert not res.available and "CUDA" in res.note
    assert [r.ceiling for r in res.rows] == [None, 16, 32, 64]
    assert all(r.device_used_above_baseline_bytes is None for r in res.rows)


def test_configs_fill_cpu_defaults() -> None:
    b = BenchConfig(device="cpu").resolved()
    assert b.model == "tiny-dense" and b.backends == ["eager", "breakable"] and b.runs >= 1
    assert b.ceiling == max(b.lengths)
    assert BenchConfig(device="cpu", backends=["disabled", "eager"]).resolved().backends == ["eager"]
    a = AnalyzeConfig(device="cpu").resolved()
    assert a.chunked_prefill_size == 256 and a.max_tokens == 256 and a.length <= 256
    # One set of machine defaults for both commands, and one thread on the CPU; analyze times fewer runs (its host
    # times stop once settled, and every validation of its predictions ran with these)
    assert b.chunked_prefill_size == a.chunked_prefill_size and (b.runs, b.warmup) == (RUNS, WARMUP)
    assert (a.runs, a.warmup) == (ANALYZE_RUNS, ANALYZE_WARMUP) == (10, 3)
    assert b.threads == a.threads == 1
    assert AnalyzeConfig(device="cpu", length=8, max_tokens=16).resolved().length == 8
    with pytest.raises(ValueError, match="--length must be in"):  # 0 is refused, not replaced by a default
        AnalyzeConfig(device="cpu", length=0).resolved()


def test_check_out_dir_creates_and_proves_the_folder(tmp_path) -> None:
    out = checks.check_out_dir(str(tmp_path / "a" / "b"))
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file is gone again
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="it is a file, not a folder"):
        checks.check_out_dir(str(tmp_path / "f"))


def _row(backend: str, median: float, q1: float, q3: float, input_len: int = 16, **kw) -> LatencyRow:
    return LatencyRow(backend=backend, input_len=input_len, num_requests=1, num_tokens=input_len,
                      wall=Stats(median, q1, q1, q3, q3, median, 0.0, 20), graph_used=backend != "eager",
                      bucket=16 if backend != "eager" else None,
                      reason="graph" if backend != "eager" else "backend_eager", **kw)


def test_bench_report_labels_cpu_speedups_and_marks_noisy_rows() -> None:
    rows = [_row("eager", 2.0, 1.9, 2.1), _row("breakable", 1.0, 0.5, 1.5)]
    compare_with_eager(rows)
    assert rows[1].speedup.over_eager == 2.0
    assert rows[1].speedup.low == pytest.approx(1.9 / 1.5) and rows[1].speedup.high == pytest.approx(2.1 / 0.5)
    assert rows[0].speedup.low is None  # eager against itself has no range
    assert rows[1].wall.spread == pytest.approx(1.0)
    builds = [BuildRecord("eager"), BuildRecord("breakable"),
              BuildRecord("full", available=False, error="refused: why", refused_reason="refused: why")]
    lat = LatencyResult(builds=builds, rows=rows)
    cfg = BenchConfig(device="cpu", backends=["eager", "breakable", "full"], lengths=[16])
    out = text.format_bench(cfg, lat, None, emulated=True)
    assert "Latency, one request (CPU emulation)" in out
    assert "Unavailable (not measured, in no speedup):\n  full: refused: why" in out
    assert "1 row(s) marked noisy" in out and out.count("noisy") >= 2
    assert f"breakable 2.00x ({CPU_SPEEDUP_NOTE})." in out
    assert "full" not in geomean_speedups(rows, cfg.backends)
    gpu = text.format_bench(cfg, lat, None, emulated=False)
    assert "CPU emulation" not in gpu and "kernel floor" in gpu and "breakable 2.00x." in gpu


def test_every_latency_column_has_a_header() -> None:
    rows = [_row("eager", 2.0, 1.9, 2.1), _row("breakable", 1.0, 0.5, 1.5)]
    compare_with_eager(rows)
    out = text.format_bench(BenchConfig(device="cpu", backends=["eager", "breakable"], lengths=[16]),
                            LatencyResult(rows=rows), None, emulated=True)
    head, rule, *_ = out.split("Latency, one request (CPU emulation)\n", 1)[1].splitlines()
    names = re.split(r"\s{2,}", head.strip())
    assert len(names) == len(rule.split()) and names[-1] == "note"  # the last column, whose cells say "noisy"


def test_device_time_and_host_overhead_per_row() -> None:
    rows = [_row("eager", 4.0, 3.9, 4.1), _row("breakable", 2.0, 1.9, 2.1)]
    compare_with_eager(rows, {("eager", 16, 1): 1.6, ("breakable", 16, 1): 1.0, ("eager+fused", 16, 1): 1.2})
    eager, breakable = rows
    assert eager.device.ms == eager.device.floor_ms == 1.6 and breakable.device.floor_ms == 1.6
    assert breakable.device.ms == 1.0 and breakable.device.host_ms == pytest.approx(1.0)
    assert breakable.device.wall_over_device == pytest.approx(2.0) and breakable.device.fused_floor_ms == 1.2
    assert breakable.device.launch_gap_share == pytest.approx(1 - 1.6 / 2.0)
    cfg = BenchConfig(device="cpu", backends=["eager", "breakable"], lengths=[16])
    out = text.format_bench(cfg, LatencyResult(rows=rows), None, emulated=False)
    head = next(line for line in out.splitlines() if "median ms" in line)
    assert "device ms" in head and "host ms" in head and "wall/device" in head
    line = next(line for line in out.splitlines() if line.startswith("breakable"))
    assert " 1.000 " in line and " 2.00x " in line  # device 1.000 ms, host 1.000 ms, wall/device 2.00x
    assert "host ms = median - device" in out
    assert "device ms" not in text.format_bench(cfg, LatencyResult(rows=rows), None, emulated=True)


def test_geomean_counts_the_lengths_each_variant_was_measured_at() -> None:
    rows = [_row("eager", 2.0, 1.9, 2.1, n) for n in (16, 32)]
    rows += [_row("breakable", 1.0, 0.9, 1.1, n) for n in (16, 32)] + [_row("full", 1.0, 0.9, 1.1, 16)]
    compare_with_eager(rows)
    cfg = BenchConfig(device="cpu", backends=["eager", "breakable", "full"], lengths=[16, 32])
    out = text.format_bench(cfg, LatencyResult(rows=rows), None, emulated=False)
    assert "each over its measured lengths: breakable 2.00x (2 lengths), full 2.00x (1 length)." in out
    alone = text.format_bench(cfg, LatencyResult(rows=rows[:4]), None, emulated=False)
    assert "Geomean speedup over eager, one request, 2 lengths: breakable 2.00x." in alone


def test_a_different_greedy_token_is_flagged_with_eagers_gap() -> None:
    rows = [_row("eager", 2.0, 1.9, 2.1, greedy=TokenCheck([7, 9], eager_top2_gap=0.0625)),
            _row("breakable", 1.0, 0.9, 1.1, greedy=TokenCheck([7, 9])),
            _row("full", 1.0, 0.9, 1.1, greedy=TokenCheck([7, 3]))]
    compare_with_eager(rows)
    assert [r.greedy.equal_eager for r in rows] == [True, True, False]
    lat = LatencyResult(builds=[BuildRecord(r.backend) for r in rows], rows=rows)
    cfg = BenchConfig(device="cpu", backends=["eager", "breakable", "full"], lengths=[16])
    out = text.format_bench(cfg, lat, None, emulated=True)
    assert "tokens = eager" in out
    assert "1 row(s) chose a different greedy token than eager: full at 16 tokens (eager's top-2 gap 0.0625)" in out


def test_the_header_names_the_device_the_model_code_and_the_tensor_parallel_size() -> None:
    from types import SimpleNamespace

    env = {"device_name": "NVIDIA H200", "model_impl": "transformers", "torch_threads": 16}
    gpu = text.header("bench", SimpleNamespace(model="/ckpt", device="cuda", emulated=False, tp=2), env)
    assert gpu == ("bcg bench: /ckpt on NVIDIA H200 (cuda), transformers model code (--model-impl), tensor parallel "
                   "size 2 (--tp), 16 torch threads (--threads).")
    analyze = text.header("analyze", SimpleNamespace(model="tiny-dense", device="cuda:1", emulated=False), env)
    assert analyze.startswith("bcg analyze: tiny-dense on NVIDIA H200 (cuda:1), transformers model code")
    assert "tensor parallel" not in analyze  # analyze runs on one device


def test_reasons_read_as_words() -> None:
    assert tables.describe_reason(True, "graph", 32) == "yes (bucket 32)"
    assert tables.describe_reason(False, "backend_refused") == "no: backend refused the model"
    assert tables.describe_reason(False, "some_new_code") == "no: some new code"


def test_sample_lengths_is_seeded_and_bounded() -> None:
    a = analyze.sample_lengths(500, 16, 2048, seed=3)
    assert a == analyze.sample_lengths(500, 16, 2048, seed=3)
    assert min(a) >= 16 and max(a) <= 2048
    # log-uniform: about half the prompts fall below the geometric midpoint (181 tokens)
    assert 0.4 < sum(x < 181 for x in a) / len(a) < 0.6


def test_variants_parse_to_canonical_names_and_reject_what_cannot_be_built() -> None:
    from bcg.bench.variants import parse_variant

    v = parse_variant(" breakable + inductor + fused ")
    assert (v.backend, v.kernels, v.compile, v.name) == ("breakable", "fused", "inductor", "breakable+fused+inductor")
    assert parse_variant("disabled").name == "eager" and parse_variant("full+traced").compile == "traced"
    assert parse_variant("eager").kernels == "torch"  # the baseline: plain torch ops, however the engine defaults
    assert parse_variant("tc_piecewise").compile_label == "inductor (pieces)"
    full = parse_variant("breakable+full+fused")
    assert (full.name, full.backend_label, full.full_graph_tokens) == ("breakable+fused+full", "breakable+full", None)
    for bad, match in (("breakable+cuda", "unknown option"), ("tc_piecewise+inductor", "compiles its pieces"),
                       ("flash", "unknown backend"), ("full+full", "full takes no \\+full")):
        with pytest.raises(ValueError, match=match):
            parse_variant(bad)


def test_first_replay_fires_once_per_arm_before_the_graph_runs_and_restores_replay() -> None:
    import torch

    import bcg
    from tests.graph_helpers import capture_simple

    g, x = bcg.BreakableCUDAGraph(emulate=True), torch.ones(4)
    out = capture_simple(g, x)
    original = bcg.BreakableCUDAGraph.replay
    seen: list[float] = []
    with timing.FirstReplay(lambda: seen.append(out.sum().item())) as first:
        x.fill_(2.0)
        g.replay()
        assert not first.fired and seen == []  # not armed: nothing
        first.arm()
        x.fill_(5.0)
        g.replay()
        g.replay()
        assert first.fired and seen == [60.0]  # once, before the replay: out still holds 4 x (2 * 2 + 1) * 3
    assert bcg.BreakableCUDAGraph.replay is original
    assert timing.replay_span_ms(g.replay, "cpu") is None  # a device span needs CUDA events
