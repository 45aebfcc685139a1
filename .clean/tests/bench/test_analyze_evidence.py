"""The H200's own numbers replayed through the prediction model on a CPU, against what the same runs measured, at
every length they hold (tests/bench/fixtures/analyze_h200.json.gz, written by ``benchmarks/analyze_targets.py
--fixture`` from the `bcg analyze --validate` runs of llama-dense, gptoss-moe, glm-dsa and a Qwen3-0.6B-shaped
checkpoint run through transformers at eb511fe, benchmarks/results/h200-2026-12-02-r7/call2-eb511fe/;
analyze_h200_all_sizes.json.gz is the run of 62e2aed, the last that timed the host at every size, for the
interpolation's test; earlier fixtures are beside their runs).

What a model entry holds decides how far the replay goes, per variant and length (``pytest -s`` prints the table):

* ``model``: the run's inputs.json (every size's profiled traces, host times and machine costs, replay paths included)
  through :func:`~bcg.bench.findings.findings`: the whole prediction model, so any change to it shows here;
* ``parts``: the program the GPU run composed at that length (``parts_by_length``, or ``parts`` at the
  representative length) played again (:func:`~bcg.bench.program.program_from_parts`,
  :func:`~bcg.bench.program.simulate`): a change to how programs are played shows, not one to how they are composed;
* ``file``: the GPU run's own prediction, where the file holds nothing to replay.

Every entry holds inputs.json, so every row is ``model``. The errors (predicted / measured - 1), with the mixed
chain's in-graph gap (0.17 µs a kernel), bcg's Triton kernels at the fused chain's (0.28) and every graph paying the
measured segment start (1.9 µs):

==========================  ======  ======  ======  ======  ======  ======
model, variant                  64     128     256     512    1024    2048
==========================  ======  ======  ======  ======  ======  ======
glm-dsa breakable           -10.5%   -9.0%   -5.4%   -3.6%   -2.4%   -0.9%
breakable+fused              -2.6%   -1.5%   -0.7%   -0.3%   +0.3%   +0.4%
breakable+inductor          -10.9%  -10.6%   -8.5%   -7.1%   -6.8%   -5.6%
gptoss-moe breakable         -6.8%   -5.5%   -4.9%   -3.1%   -2.6%   -4.0%
breakable+fused              -6.9%   -4.7%   -4.2%   -2.0%   -2.1%   -1.7%
full                         -3.8%   -2.8%   -1.5%   -0.3%   -0.5%   -2.4%
tc_piecewise                 +0.8%   +3.0%   +3.9%   +6.7%   +8.9%   +8.4%
breakable+inductor           -1.9%   -1.9%   +2.3%   +5.6%   +8.6%   +8.9%
llama-dense breakable       -11.7%  -10.4%   -8.2%   -6.3%   -4.8%   -3.9%
breakable+fused             -12.1%  -11.9%  -11.5%  -12.7%   -7.4%   -6.4%
full                         -5.0%   -2.7%   -2.0%   -0.6%   -0.1%   -0.2%
tc_piecewise                 -4.0%   -2.9%   -2.0%   +1.5%   +5.1%   +7.8%
breakable+inductor           -8.0%   -4.3%   -4.7%   -0.2%   +4.7%   +7.1%
qwen3-0.6b breakable         -9.0%   -6.5%   -4.8%   -4.2%   -1.4%   -2.4%
breakable+fused             -10.8%   -9.4%   -5.9%   -5.0%   -3.3%   -3.5%
full                         -4.7%   -3.3%   -1.6%   -1.2%   +0.1%   +0.1%
breakable+inductor           +5.9%   +8.5%   +9.2%  +10.2%   +7.9%   +9.0%
==========================  ======  ======  ======  ======  ======  ======

The breakable backends' short prompts are still short of their measurement: the runs' step-by-step replays spent 3-12
µs a segment beyond their kernels, where the probe measured 1.9 (one run of the same call, the budget run, measured
llama-dense's breakable+fused within 10.1%: the runs' own spread is 2-3%). glm-dsa's breakable+inductor, -50% before
its compiled sparse attention was captured in the segments, is within 11%. The transformers checkpoint's tc_piecewise
was predicted to capture but its build failed on the H200 (Inductor specialised the token count), so it holds no row.

Graph memory (``MEMORY_FACTOR``): the full ladder's predicted resident memory is 0.42-1.09x what the builds measured
(glm-dsa's breakable backends the least; the compiled variants 0.53-1.00x since a compiled layer stack keeps its
island-crossing outputs per bucket as tc_piecewise's pieces do, 0.05x before). The gap of the uncompiled breakable
ladders (100-500 MiB) is not yet placed: more per segment graph than the probe's one-kernel graphs, or the allocator's
blocks.

:data:`BOUND` is each variant's worst over the models, rounded up to the next 5%: tighten it when a fixture from a
newer run earns it (the target is 10%). Regenerate the fixture from an H200 run with ``python
benchmarks/analyze_targets.py OUT/analyze-*/results.json --fixture tests/bench/fixtures/analyze_h200.json.gz`` (its
inputs.json come along).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from bcg.bench import replay
from bcg.bench.findings import findings
from bcg.bench.predict import program_from_parts, simulate

FIXTURE = Path(__file__).parent / "fixtures" / "analyze_h200.json.gz"  # with the runs' inputs.json
ALL_SIZES = Path(__file__).parent / "fixtures" / "analyze_h200_all_sizes.json.gz"  # host timed at every size
# |predicted / measured - 1| per variant, over both models and every length (the docstring's table)
BOUND = {"breakable": 0.15, "breakable+fused": 0.15, "full": 0.10, "tc_piecewise": 0.10, "breakable+inductor": 0.15}
# (model, variant) -> bound, where the model is known to miss something (see the module doc)
EXCEPTIONS: dict[tuple[str, str], float] = {}
INTERPOLATED = 0.03  # how far host times interpolated between three sizes may move a prediction
# predicted / measured graph memory stays within this factor either way (see the module doc)
MEMORY_FACTOR = 2.5
COMPOSITION = 0.03  # a replay of the parts against the GPU run's own prediction (parts share their time evenly)


def read_fixture(path: Path) -> dict:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)


def replayed(entry: dict) -> list[tuple[str, int, float, float, float, str]]:
    """(variant, tokens, the run's prediction, the replay's, measured, how) for every measured length of one model
    entry of the fixture (see the module doc for ``how``)."""
    model = None
    if entry.get("inputs"):
        model = findings(replay.load(entry["inputs"]))["predictions"]
    rows = []
    for v, x in entry["variants"].items():
        for key, measured in x["measured_ms"].items():
            n = int(key)
            parts = (x.get("parts_by_length") or {}).get(key) or (x["parts"] if n == entry["length"] else None)
            if model is not None:
                ms, how = model[v][n], "model"
            elif parts:
                ms, how = simulate(program_from_parts(parts)).wall_ms, "parts"
            else:
                ms, how = x["predicted_ms"][key], "file"
            rows.append((v, n, x["predicted_ms"][key], ms, measured, how))
    return rows


def test_the_h200_runs_replay_within_the_bound_at_every_length() -> None:
    data = read_fixture(FIXTURE)
    assert {"llama-dense", "gptoss-moe", "glm-dsa", "qwen3-0.6b (transformers)"} <= set(data["models"])
    print(f"\n{'model':12} {'variant':20} {'tokens':>6} {'run ms':>8} {'replay ms':>9} {'measured':>8} "
          f"{'error':>7} how")
    for name, entry in data["models"].items():
        rows = replayed(entry)
        assert {n for _, n, *_ in rows} == set(entry["lengths"]) == {64, 128, 256, 512, 1024, 2048}
        assert {r[0] for r in rows} <= set(BOUND)
        for v, n, run_ms, ms, measured, how in rows:
            print(f"{name:12} {v:20} {n:6d} {run_ms:8.3f} {ms:9.3f} {measured:8.3f} {ms / measured - 1:+7.1%} {how}")
            if how == "parts":  # the program the run composed plays to the run's own prediction
                assert ms == pytest.approx(run_ms, rel=COMPOSITION), (name, v, n)
            assert abs(ms / measured - 1) <= EXCEPTIONS.get((name, v), BOUND[v]), (name, v, n, ms, measured)
        assert {how for v, n, *_, how in rows if n == entry["length"]} <= {"parts", "model"}


def test_graph_memory_replays_within_its_bound_of_what_the_builds_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """The predicted resident graph memory of every variant's full ladder against what its build measured (free device
    memory before and after capturing, the allocator's unused blocks released), replayed like the latencies."""
    data = read_fixture(FIXTURE)
    rows = []
    for name, entry in data["models"].items():
        forecasts = findings(replay.load(entry["inputs"]))["forecasts"]
        for v, x in entry["variants"].items():
            measured = x.get("measured_graph_memory_bytes")
            if measured:
                rows.append((name, v, forecasts[v]["graph_memory_bytes"], measured))
    assert len(rows) >= 15
    with capsys.disabled():
        print("\ngraph memory, MiB predicted / measured:")
        for name, v, predicted, measured in rows:
            print(f"  {name:28} {v:20} {predicted / 2**20:8.0f} {measured / 2**20:8.0f} {predicted / measured:6.2f}x")
    for name, v, predicted, measured in rows:
        assert 1 / MEMORY_FACTOR <= predicted / measured <= MEMORY_FACTOR, (name, v, predicted, measured)


def test_the_fixture_holds_the_machines_microbenchmarks_the_programs_came_from() -> None:
    data = read_fixture(FIXTURE)
    for m in data["models"].values():
        costs = m["machine"]
        assert costs["device"] == "cuda" and not costs["emulated"]
        # the programs' graph launches are the machine's: a segment costs its measured launch plus its nodes
        segment = m["variants"]["breakable"]["parts"]["segment"]
        per_launch = costs["graph_launch_us"] + costs["graph_launch_per_node_us"] * segment["nodes"] / segment["count"]
        assert segment["host_us"] / segment["count"] == pytest.approx(per_launch, rel=1e-6)
        # the measured replay of the representative bucket sits beside the predicted program
        assert m["replay"]["bucket"] == m["length"] and m["replay"]["replay_ms"] > 0


def test_a_fixture_with_the_runs_inputs_replays_the_whole_model(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The path the next H200 fixture takes: a validated run's inputs.json through findings(), here a CPU run's,
    which must give back exactly the run's own predictions at every length (nothing in the replay differs)."""
    from bcg.cli import main

    out = tmp_path / "run"
    assert main(["analyze", "--device", "cpu", "--runs", "2", "--warmup", "0", "--no-progress", "--no-plots",
                 "--chunked-prefill-size", "32", "--predict-lengths", "8,16", "--length", "16", "--lengths", "5,30",
                 "--backends", "breakable,full", "--validate", "--out", str(out)]) == 0
    capsys.readouterr()
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from analyze_targets import main as targets
    finally:
        sys.path.pop(0)
    assert targets([str(out / "results.json"), "--fixture", str(tmp_path / "fixture.json.gz")]) == 0
    assert "fixture:" in capsys.readouterr().out
    entry = read_fixture(tmp_path / "fixture.json.gz")["models"]["tiny-dense"]
    assert entry["inputs"]["schema"] == replay.SCHEMA and entry["inputs"]["measured"] is None
    rows = replayed(entry)
    assert {(v, n) for v, n, *_ in rows} == {(v, n) for v in ("breakable", "full") for n in (8, 16)}
    for v, n, run_ms, ms, _, how in rows:
        assert how == "model" and ms == run_ms, (v, n)
    assert set(entry["variants"]["breakable"]["parts_by_length"]) == {"8", "16"}


def test_host_times_interpolated_between_three_sizes_predict_as_well(capsys: pytest.CaptureFixture[str]) -> None:
    """``bcg analyze`` times the eager host work at three of the six sizes and interpolates the rest
    (:mod:`bcg.bench.host_sizes`): on the H200's inputs, every prediction moves by at most :data:`INTERPOLATED` and
    stays within 40% of what the runs measured (that run's replay paths under-counted a layer: the errors are its)."""
    from bcg.bench.host_sizes import interpolate, timed_sizes

    data = read_fixture(ALL_SIZES)
    worst = 0.0
    for name, entry in data["models"].items():
        m = replay.load(entry["inputs"])
        full = findings(m)["predictions"]
        for by_setting in m.hosts.values():
            for setting, by_size in by_setting.items():
                sizes = sorted(by_size)
                by_setting[setting] = interpolate({n: by_size[n] for n in timed_sizes(sizes)}, sizes)
        fewer = findings(m)["predictions"]
        for v, x in entry["variants"].items():
            for key, measured in x["measured_ms"].items():
                n = int(key)
                moved = fewer[v][n] / full[v][n] - 1
                worst = max(worst, abs(moved))
                assert abs(moved) <= INTERPOLATED, (name, v, n, moved)
                assert abs(fewer[v][n] / measured - 1) <= 0.40, (name, v, n)
    with capsys.disabled():
        print(f"\ninterpolated host times move the predictions by at most {worst:.1%}")
