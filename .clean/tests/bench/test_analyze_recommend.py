"""The recommendation of `bcg analyze` under graph-memory budgets, what it reports (the JSON's shape, with and without
validation and core counts), the verdict, and the workload files it reads; all on synthetic inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from analyze_cases import costs, host, profiled

from bcg.bench import checks
from bcg.bench.findings import Measurements, findings
from bcg.bench.forecast import Forecast
from bcg.bench.recommend import Workload, candidate_ladders, expected_ms, recommend
from bcg.bench.results import analyze_summary, jsonable
from bcg.bench.validate import Measured
from bcg.bench.verdict import verdict
from bcg.runtime.runner.buckets import default_ladder

PADDING = (2.0, 64)
PER_BUCKET = 100 * 1024 + 10 * 65536  # 100 nodes and 10 graphs per bucket at costs()'s bytes


def flat(variant: str, ms: float, compile_ms: float = 0.0, spread: float = 0.0, nodes: int = 100) -> Forecast:
    """A forecast replaying any bucket in ``ms`` (its interval ``ms`` +- ``spread``), ``nodes`` nodes and 10 graphs a
    bucket, a pool of 1e8 bytes at 2048 tokens (0 at 16, linear between)."""
    return Forecast(variant, True, replay_ms={16: ms, 2048: ms}, nodes={16: nodes, 2048: nodes},
                    graphs={16: 10, 2048: 10}, activation={16: 0.0, 2048: 1e8}, compile_ms=compile_ms,
                    replay_low_ms={16: ms - spread, 2048: ms - spread},
                    replay_high_ms={16: ms + spread, 2048: ms + spread})


def run(forecasts: list[Forecast], budget: float | None, eager_ms: float = 5.0,
        lengths: tuple[int, ...] = (100, 300, 2048)):
    return recommend(Workload(lengths, "test"), 2048, forecasts, {"eager": lambda n: eager_ms}, lambda n: 0.0,
                     lambda v: "eager", lambda fc, b: fc.graph_memory_bytes(b, costs()),
                     lambda fc, b: fc.build_ms(b, lambda n: (1.0, 0.9), costs(), 2), PADDING, budget)


def test_without_a_budget_the_whole_ladder_up_to_the_chunk() -> None:
    rec = run([flat("breakable", 1.0)], None)
    assert (rec.backend, rec.ceiling, rec.buckets) == ("breakable", 2048, default_ladder(2048))
    assert rec.expected_ms == pytest.approx(1.0) and rec.speedup == pytest.approx(5.0)
    assert rec.graph_memory_bytes == pytest.approx(1e8 + 42 * PER_BUCKET)


def test_a_tight_budget_first_drops_buckets_the_workload_never_fires() -> None:
    rec = run([flat("breakable", 1.0)], 110e6)
    assert (rec.ceiling, rec.buckets) == (2048, [112, 320, 2048])  # what 100, 300 and 2048 tokens replay
    assert rec.graph_memory_bytes == pytest.approx(1e8 + 3 * PER_BUCKET) and rec.graph_memory_bytes <= 110e6
    assert rec.expected_ms == pytest.approx(1.0)  # the same latency on this workload
    assert "never fires" in rec.reason


def test_a_tighter_budget_lowers_the_ceiling_and_the_long_prompts_run_eagerly() -> None:
    rec = run([flat("breakable", 1.0)], 60e6)
    assert (rec.ceiling, rec.buckets) == (1024, [112, 320, 1024])
    assert rec.graph_memory_bytes <= 60e6
    # the 2048-token prompt is one chunk of 2048, above the ceiling: it runs eagerly (5 ms), the others replay
    assert rec.expected_ms == pytest.approx((1.0 + 1.0 + 5.0) / 3)
    assert "forwards above 1024 tokens" in rec.reason


def test_a_budget_no_ladder_fits_recommends_eager() -> None:
    rec = run([flat("breakable", 1.0)], 1e6)
    assert rec.backend == "eager" and rec.ceiling is None and rec.buckets == []
    assert "fits the graph-memory budget" in rec.reason
    assert [o.fits for o in rec.options] == [True, False]


def test_graphs_that_do_not_pay_are_not_recommended() -> None:
    rec = run([flat("breakable", 4.9)], None)
    assert rec.backend == "eager" and "do not pay" in rec.reason
    assert "1.02x eager here, under the 5% a graph must gain" in rec.reason  # the threshold is named


def test_a_near_tie_goes_to_the_faster_build() -> None:
    rec = run([flat("breakable", 1.00), flat("tc_piecewise", 0.99, compile_ms=20_000.0)], None)
    assert rec.backend == "breakable" and "a tie with the fastest (tc_piecewise" in rec.reason
    clear = run([flat("breakable", 1.00), flat("tc_piecewise", 0.90, compile_ms=20_000.0)], None)
    assert clear.backend == "tc_piecewise"


def test_overlapping_intervals_tie_and_the_tie_goes_to_the_cheaper_build_then_less_memory() -> None:
    wide = [flat("breakable", 1.00, spread=0.05), flat("tc_piecewise", 0.90, compile_ms=20_000.0, spread=0.06)]
    rec = run(wide, None)  # 0.95 (breakable's low) <= 0.96 (tc_piecewise's high): a tie, the cheaper build wins
    assert rec.backend == "breakable" and "inside the spread" in rec.reason
    breakable = next(o for o in rec.options if o.variant == "breakable")
    assert breakable.bounds() == pytest.approx((0.95, 1.05))
    apart = run([flat("breakable", 1.00, spread=0.02), flat("tc_piecewise", 0.90, compile_ms=20_000.0, spread=0.02)],
                None)
    assert apart.backend == "tc_piecewise"  # 0.98 > 0.92: no overlap, the faster one
    # tied again: the one holding fewer kernel nodes wins (it captures faster and holds less graph memory)
    lean = run([flat("breakable", 1.00, spread=0.05, nodes=400), flat("full", 0.99, spread=0.05, nodes=100)], None)
    assert lean.backend == "full"
    heavy = run([flat("breakable", 0.99, spread=0.05, nodes=100), flat("full", 1.00, spread=0.05, nodes=400)], None)
    assert heavy.backend == "breakable"


def test_unavailable_forecasts_are_skipped() -> None:
    rec = run([Forecast("full", False, "backend 'full' cannot capture this model"), flat("breakable", 1.0)], None)
    assert rec.backend == "breakable" and [o.variant for o in rec.options] == ["eager", "breakable"]


def test_expected_latency_adds_up_chunks_and_counts_the_overhead_once() -> None:
    w = Workload((5000,), "one long prompt")
    choose = lambda n: (2048, "graph") if n == 2048 else (None, "exceeds_max_bucket")  # noqa: E731
    ms = expected_ms(w, 2048, replay=lambda b: 2.0, eager=lambda n: 7.0, overhead=lambda n: 0.5, choose=choose)
    assert ms == pytest.approx(2.0 + 2.0 + 7.0 - 2 * 0.5)  # 2048 + 2048 replayed, 904 eager, one overhead


def test_candidate_ladders_in_order_of_preference() -> None:
    from bcg.bench.recommend import _choose

    out = candidate_ladders(2048, [2048, 2048], lambda b: _choose(b, PADDING))
    assert [(c, p) for c, _, p in out][:4] == [(2048, False), (2048, True), (1024, False), (1024, True)]
    assert out[1][1] == [2048]  # every forward is a whole chunk: one bucket serves them all


# ---------------------------------------------------------------------------------------------- findings


def measurements(validated: bool = False, cores: list[int] | None = None) -> Measurements:
    sizes = [64, 128]
    m = Measurements(variants=["breakable", "full", "tc_piecewise"], chunk=128, max_tokens=128, length=64,
                     predict_lengths=[64, 128], workload=Workload((50, 100, 300), "test"), costs={}, hosts={},
                     profiles={}, num_params=10, emulated=False, tc_compiler="inductor", cores=cores or [])
    for k in [None, *(cores or [])]:
        m.costs[k] = costs(eager_launch_us=10.0 * (1 + (k or 0)))
        m.hosts[k] = {"torch": {n: host(n, prefill_ms=1.5 + n / 1000 + (k or 0)) for n in sizes}}
    m.profiles = {"torch": {n: profiled(n) for n in sizes}}
    if validated:
        m.measured = {v: Measured(v, True, ms={64: 0.7, 128: 0.8}, by_cores={k: {64: 0.9} for k in m.cores},
                                  build_ms=5.0, graph_memory_bytes=2**20) for v in m.variants}
    return m


def test_a_variant_whose_build_failed_in_the_validation_is_not_recommended() -> None:
    m = measurements(validated=True)
    first = findings(m)["recommendation"]["backend"]
    assert first in {"breakable", "full", "tc_piecewise"}
    m.measured[first] = Measured(first, False, error="BackendRefused: the token count was specialised")
    out = findings(m)
    assert out["recommendation"]["backend"] not in {first, "eager"}  # the next fastest graph backend, not it
    assert out["forecasts"][first]["available"]  # the forecast itself stays what was predicted
    assert out["validation"][first]["predicted_available"] and not out["validation"][first]["available"]


def test_findings_shape_and_values() -> None:
    out = findings(measurements())
    assert set(out["predictions"]) == {"eager", "breakable", "full", "tc_piecewise"}
    assert all(set(ms) == {64, 128} for ms in out["predictions"].values())
    assert out["predictions"]["eager"][64] == pytest.approx(1.5 + 0.064)  # measured, not predicted
    # 64 tokens replays bucket 64: the hand-worked breakable program plus the prefill's 564 us instead of 500
    assert out["predictions"]["breakable"][64] == pytest.approx(0.658 + 0.064)
    assert {"backend", "ceiling", "buckets"} <= set(out["recommendation"])
    params = out["parameters"]
    assert set(params) >= {"launch_gap_share", "dynamic_share", "bucket_coverage", "resident_graph_memory_bytes"}
    assert params["launch_gap_share"] == pytest.approx(1 - 0.139 / 1.0)  # 139 us of kernels in a 1 ms forward
    # what stays eager: two 30 us islands, the 20 us load and the 564 us of the engine, over the 1.564 ms prefill
    assert params["dynamic_share"] == pytest.approx((60 + 20 + 564) / 1564)
    assert params["bucket_coverage"]["chunked_prefill_size"] == 128
    assert out["islands"][0]["name"] == "attention_island" and out["islands"][0]["calls"] == 2
    assert out["islands"][0]["device_us"] == pytest.approx(8.0)
    assert "measured" not in out and "errors" not in out and "cpu_cores" not in out
    assert out["amdahl"]["predicted_speedup"] == pytest.approx(1.564 / 0.722)


def test_the_fusion_rule_is_set_against_the_fused_kernels_own_timings() -> None:
    m = measurements()
    assert findings(m)["fusion_check"] is None  # no fused profile, nothing to check against
    m.variants.append("breakable+fused")
    m.hosts[None]["fused"] = dict(m.hosts[None]["torch"])
    m.profiles["fused"] = {n: profiled(n, pointwise_us=1.0) for n in (64, 128)}
    check = findings(m)["fusion_check"][64]
    # the graph work of layer_trace(): a 1 us upload, per layer 3 + 20 + 3 + 1 + 1 (before the island) and
    # 20 + 3 (after it), and the 20 us LM head
    assert check["torch_us"] == pytest.approx(1 + 2 * (28 + 23) + 20)
    # by the rule each run of pointwise kernels between matmuls (and islands) is its longest plus 0.3 of the rest:
    # [upload 1] [rms] mm [rope kv kv] | mm [add rms] mm [rope kv kv] | mm [add] mm
    assert check["rule_us"] == pytest.approx((1 + 3 + 20 + 3.6) + (20 + 3.9 + 20 + 3.6) + (20 + 3 + 20))
    assert check["fused_kernels_us"] == pytest.approx(1 + 2 * (1 + 20 + 1 + 1 + 1 + 20 + 1) + 20)


def test_validated_findings_have_measured_and_errors_shaped_like_predictions() -> None:
    out = findings(measurements(validated=True, cores=[1, 2]))
    graph = {"breakable", "full", "tc_piecewise"}
    assert graph <= set(out["measured"]) and set(out["errors"]) == graph
    for v in graph:
        assert set(out["errors"][v]) == set(out["predictions"][v])
        assert out["errors"][v][64] == pytest.approx(out["predictions"][v][64] / 0.7 - 1)
    assert out["validation"]["full"]["predicted_available"] is True
    # on the workload (50, 100, 300 tokens; chunk 128): buckets 64 (0.7 ms), 112 (0.775, between the measured
    # lengths) and 128 + 128 + 48 (0.8 + 0.8 + 0.7, flat below the first length)
    assert out["measured_expected_ms"]["breakable"] == pytest.approx((0.7 + 0.775 + 2.3) / 3)
    assert set(out["cpu_cores"]) == {1, 2}
    row = out["cpu_cores"][2]
    assert row["measured"]["breakable"] == 0.9 and row["measured"]["eager"] == pytest.approx(3.564)
    assert row["predictions"]["eager"] == pytest.approx(3.564)
    # a slower launch on fewer cores slows every island's K/V-write launch of tc_piecewise
    assert out["cpu_cores"][2]["predictions"]["tc_piecewise"] > out["cpu_cores"][1]["predictions"]["tc_piecewise"]


def _analysis(emulated: bool = False, validated: bool = False) -> dict:
    a = findings(measurements(validated=validated))
    a.update(environment={"emulated": emulated, "device_name": "NVIDIA H200"}, length=64)
    return a


def test_verdict_names_the_recommendation_and_the_four_parameters() -> None:
    v = verdict(_analysis())
    assert v["pays"] is True and v["backend"] == v["sentence"].split()[1]
    s = v["sentence"]
    assert s.startswith(f"Use {v['backend']} with max_tokens={v['recommended_ceiling']}")
    for words in ("launch gap", "dynamic share", "chunked_prefill_size 128", "resident graph memory"):
        assert words in s
    assert "Measured" not in s
    checked = verdict(_analysis(validated=True))["sentence"]
    assert "Measured on this workload" in checked and "fastest" in checked
    cpu = verdict(_analysis(emulated=True))
    assert cpu["pays"] is None and cpu["sentence"].startswith("CPU emulation")


def test_summary_line_has_predictions_recommendation_and_measured(tmp_path: Path) -> None:
    from types import SimpleNamespace

    a = _analysis(validated=True)
    a.update(verdict=verdict(a), timings={"predict_s": 1.0, "validate_s": 4.0}, plots=[])
    data = jsonable(a)
    s = json.loads(json.dumps(analyze_summary(SimpleNamespace(model="m", emulated=False), data, tmp_path / "r")))
    assert set(s["recommendation"]) == {"backend", "ceiling", "buckets"}
    assert s["predictions"]["breakable"].keys() == s["measured"]["breakable"].keys() == s["errors"]["breakable"].keys()


# ---------------------------------------------------------------------------------------------- workload files


def test_workload_files_lengths_json_and_json_lines(tmp_path: Path) -> None:
    f = tmp_path / "w.txt"
    f.write_text("4, 8  # short\n12\n")
    assert checks.read_lengths_file(str(f)) == [4, 8, 12]
    f.write_text('[{"input_len": 300, "output_len": 2}, {"prompt_tokens": 5}, {"prompt": [1, 2, 3]}]')
    assert checks.read_lengths_file(str(f)) == [300, 5, 3]
    f.write_text('{"prompt_len": 7}\n\n{"num_prompt_tokens": 9}\n')
    assert checks.read_lengths_file(str(f)) == [7, 9]
    f.write_text("[16, 32]")
    assert checks.read_lengths_file(str(f)) == [16, 32]
    f.write_text('[{"prompt": "hello"}]')
    with pytest.raises(ValueError, match="gives its prompt as text"):
        checks.read_lengths_file(str(f))
    f.write_text('[{"output_len": 3}]')
    with pytest.raises(ValueError, match="request 0 has no prompt length"):
        checks.read_lengths_file(str(f))
    f.write_text('{"input_len": 3}\n{broken\n')
    with pytest.raises(ValueError, match="neither JSON nor JSON lines"):
        checks.read_lengths_file(str(f))


def test_memory_sizes() -> None:
    assert checks.parse_size("2GiB") == 2 * 2**30 and checks.parse_size("512 MiB") == 512 * 2**20
    assert checks.parse_size("1.5GB") == 1_500_000_000 and checks.parse_size("100") == 100
    for bad in ("lots", "2 parsecs", "-1GiB", "0"):
        with pytest.raises(ValueError):
            checks.parse_size(bad)
