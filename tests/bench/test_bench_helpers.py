"""Small pure helpers of bcg.bench: timing, tables/JSON, configs, the verdict, and the modules' doctests."""

from __future__ import annotations

import doctest
import importlib
import json
import math

import pytest

from bcg.bench import analyze, report, timing
from bcg.bench.config import AnalyzeConfig, BenchConfig
from bcg.bench.engines import split_tokens
from bcg.bench.memory import ceilings_for, run_memory


@pytest.mark.parametrize("name", ["amdahl", "report", "timing", "config", "engines", "memory", "analyze"])
def test_doctests(name: str) -> None:
    mod = importlib.import_module(f"bcg.bench.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_time_fn_and_marks_on_cpu() -> None:
    calls = []
    t = timing.time_fn(lambda: calls.append(1), "cpu", runs=4, warmup=2)
    assert len(calls) == 6 and len(t.samples_ms) == 4 and t.min_ms <= t.median_ms
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
    text = report.table(["name", "ms"], [["a", "1.5"], ["long name", "10.25"]])
    lines = text.splitlines()
    assert lines[2].endswith(" 1.5") and lines[3].endswith("10.25")
    assert len({len(line) for line in lines[1:]}) == 1


def test_json_has_no_nan_or_inf(tmp_path) -> None:
    path = report.write_json(tmp_path / "x" / "r.json", {"a": math.inf, "b": [math.nan, 1.0]})
    assert json.loads(path.read_text()) == {"a": None, "b": [None, 1.0]}


def test_split_tokens_and_ceilings() -> None:
    assert split_tokens(64, 16) == [4] * 16
    assert sum(split_tokens(100, 16)) == 100 and max(split_tokens(100, 16)) - min(split_tokens(100, 16)) <= 1
    assert [c for _, _, c in ceilings_for(4)] == [None, 1, 2, 4]
    assert [c for _, _, c in ceilings_for(2)] == [None, 1, 2]  # 1/4 of 2 rounds to 0 and is dropped


def test_memory_on_cpu_is_none_with_a_note() -> None:
    res = run_memory("tiny-dense", "cpu", None, seed=0, chunk=64, progress=False)
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


def _analysis(speedup: float, share: float | None, emulated: bool = False) -> dict:
    return {
        "environment": {"emulated": emulated},
        "timing": {"length": 512, "measured_speedup": speedup, "launch_gap_share": 0.1},
        "amdahl": {"p": 0.2, "s_max": 5.0, "predicted_speedup": speedup * 1.1},
        "coverage": {"chunked_prefill_size": 2048, "recommended_ceiling": 2048, "graph_fraction": 0.9,
                     "never_fired": [4, 8], "num_buckets": 42},
        "memory": {"graph_share_of_free": share},
    }


def test_verdict_sentences() -> None:
    yes = analyze.verdict(_analysis(1.8, 0.01))
    assert yes["pays"] is True and yes["sentence"].startswith("Breakable graphs pay here: 1.80x")
    assert "set the capture ceiling to 2048 (= chunked_prefill_size)" in yes["sentence"]
    no = analyze.verdict(_analysis(1.01, 0.01))
    assert no["pays"] is False and "do not pay" in no["sentence"] and "10% launch gap" in no["sentence"]
    big = analyze.verdict(_analysis(1.8, 0.5))
    assert big["pays"] is True and "50% of free memory" in big["sentence"]
    cpu = analyze.verdict(_analysis(1.8, None, emulated=True))
    assert cpu["pays"] is None and cpu["sentence"].startswith("CPU emulation")
    assert "without fusing kernels" not in yes["sentence"]  # no kernel time measured, no bound claimed
    bounded = _analysis(1.8, 0.01)
    bounded["timing"]["launch_bound"] = 2.4
    assert "no graph beats eager by more than 2.40x here without fusing kernels" in analyze.verdict(bounded)["sentence"]


def test_sample_lengths_is_seeded_and_bounded() -> None:
    a = analyze.sample_lengths(500, 16, 2048, seed=3)
    assert a == analyze.sample_lengths(500, 16, 2048, seed=3)
    assert min(a) >= 16 and max(a) <= 2048
    # log-uniform: about half the prompts fall below the geometric midpoint (181 tokens)
    assert 0.4 < sum(x < 181 for x in a) / len(a) < 0.6
