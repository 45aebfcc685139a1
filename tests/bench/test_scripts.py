"""The runnable benchmark scripts run end to end on the CPU (their smoke mode) and print their JSON last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_path_smoke(tmp_path: Path) -> None:
    out = tmp_path / "hp"
    result = run_script("host_path.py", "--model", "tiny-dense", "--device", "cpu", "--tokens", "12",
                        "--requests", "3", "--runs", "2", "--calls", "5", "--out", str(out))
    assert result["tokens"] == 12 and result["replay"]["breaks"] == 2  # tiny-dense: two attention islands
    assert set(result["prefill"]) == {"1", "3"}
    assert all(t["wall_ms"] >= t["host_ms"] > 0 for row in result["prefill"].values() for t in row.values())
    assert (out / "host_path.json").exists() and "prefill" in (out / "profile_3req.txt").read_text()
    stages = {st["stage"]: st for st in result["stages"]}
    # The steps before the replay start in order, each after the last one ended, and the replay holds the forward.
    order = ["validate prompts", "reserve KV slots", "plan the forward", "choose the bucket", "load the batch",
             "breakable graph replay call", "logits and greedy tokens", "after the launch"]
    assert [stages[name]["start_us"] for name in order] == sorted(stages[name]["start_us"] for name in order)
    assert stages["prefill"]["us"] >= stages["breakable graph replay call"]["us"] > 0


def test_serve_capacity_smoke(tmp_path: Path) -> None:
    """Both ways serve every request of the same workload; the verdict compares them."""
    result = run_script("serve_capacity.py", "--rate", "120", "--duration", "0.5", "--rounds", "1",
                        "--out", str(tmp_path / "cap.json"))
    assert result["kind"] == "serve_capacity" and result["requests"] > 20
    for way in ("submit", "prefill_loop"):
        (run,) = result["runs"][way]
        assert run["tokens_per_s"] > 0 and 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
    assert result["runs"]["submit"][0]["submit_ms"]["p99"] > 0 and result["runs"]["prefill_loop"][0]["forwards"] >= 1
    assert result["verdict"]["submit_over_loop"] > 0 and (tmp_path / "cap.json").exists()


def test_device_bound_smoke(tmp_path: Path) -> None:
    out = tmp_path / "db"
    result = run_script("device_bound.py", "--models", "tiny-dense,tiny-dsa", "--backends", "breakable,full",
                        "--lengths", "8,24", "--runs", "1", "--out", str(out))
    assert result["kind"] == "device_bound" and len(result["results"]) == 4
    by = {(r["model"], r["backend"]): r for r in result["results"]}
    assert by[("tiny-dense", "breakable")]["attention_backend"] == "sdpa"
    assert by[("tiny-dense", "full")]["attention_backend"] == "static"
    for r in result["results"]:
        assert [row["tokens"] for row in r["rows"]] == [8, 24] and all(row["wall_ms"] > 0 for row in r["rows"])
        assert r["sync_free"] == "n/a (CPU)" and r["rows"][0]["device_ms"] is None  # no device time on a CPU
    assert not by[("tiny-dsa", "full")]["rows"][0]["graph_used"]  # full refuses DSA: eager, with the reason logged
    assert (out / "device_bound.json").exists()


def test_tp_tokens_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "tp_tokens.py"), "--model", "tiny-moe", "--backends", "breakable",
           "--lengths", "8,16", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "model": "tiny-moe", "tp": 2, "all_ok": True, "results": str(tmp_path / "tp_tokens.json")}
    rows = json.loads((tmp_path / "tp_tokens.json").read_text())["rows"]
    assert [(r["tokens"], r["same_token"], r["graph_used"]) for r in rows] == [(8, True, True), (16, True, True)]
    assert all(r["rel_logit_diff"] < 1e-5 for r in rows)  # fp32 on the CPU: sharding changes only rounding


def test_tp_compare_checks_the_multi_gpu_targets() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from tp_compare import compare
    finally:
        sys.path.pop(0)

    def bench(tp: int, breakable_ms: float, capture_ms: float) -> dict:
        rows = [{"backend": b, "input_len": n, "wall": {"median_ms": ms}, "speedup": {"over_eager": 10.0 / ms}}
                for n in (64, 512) for b, ms in (("eager", 10.0), ("breakable", breakable_ms))]
        return {"config": {"tp": tp}, "rows": rows, "builds": [{"backend": "breakable", "capture_ms": capture_ms}]}

    lines, verdict = compare(bench(1, 4.0, 1000.0), bench(2, 4.2, 1400.0))
    assert verdict["breakable_speedup_within_10pct"] and verdict["breakable_capture_within_1_5x"]
    assert any("| breakable | 512 | 4.00 | 2.50x | 4.20 | 2.38x | 0.95 |" == line for line in lines)
    _, slow = compare(bench(1, 4.0, 1000.0), bench(2, 5.0, 1600.0))
    assert not slow["breakable_speedup_within_10pct"] and not slow["breakable_capture_within_1_5x"]


def test_soak_smoke() -> None:
    result = run_script("soak.py", "--prefills", "40", "--presets", "tiny-dense", "--failure-rate", "0.2",
                        "--warmup", "10", "--sample-every", "10", "--threads", "2")
    stats = result["stats"]["tiny-dense"]
    assert result["ok"] and stats["prefills"] == 40 and stats["mismatches"] == 0 and stats["pool_leaks"] == 0
    assert stats["injected"] > 0 and stats["failed_replays"] > 0  # faults happened, and were survived
    assert stats["replay_failures_recorded"] == stats["failed_replays"]
    assert len(result["memory"]) >= 2


def test_summarize_tables_a_bench_run_and_its_token_check(tmp_path: Path) -> None:
    from bcg.cli import main

    out = tmp_path / "tiny-dense"
    assert main(["bench", "--model", "tiny-dense", "--device", "cpu", "--backends", "eager,breakable", "--lengths",
                 "8", "--runs", "1", "--warmup", "0", "--batch-requests", "1", "--no-memory", "--no-plots",
                 "--no-progress", "--out", str(out)]) == 0
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize.py"), str(out)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "### tiny-dense" in proc.stdout and "| 8 |" in proc.stdout
    assert "Greedy tokens equal eager's in 2 of 2 rows." in proc.stdout


def test_summarize_refuses_what_is_not_a_bench_run_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "analyze").mkdir()
    (tmp_path / "analyze" / "results.json").write_text('{"schema": "bcg.analyze/2", "kind": "analyze"}')
    (tmp_path / "empty").mkdir()
    for folder, message in ((tmp_path / "missing", "is not a folder"),
                            (tmp_path / "empty", "results.json' cannot be read (No such file or directory)"),
                            (tmp_path / "analyze", "holds the results of bcg analyze; this script tables those of "
                             "bcg bench")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize.py"), str(folder)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.startswith(f"summarize.py: error: '{folder}") and message in proc.stderr, proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script measures (the H200 run)")
def test_pdl_refuses_without_a_gpu() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pdl.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "programmatic dependent launch on a GPU" in proc.stderr


def _script_module(name: str):
    import importlib.util as iu

    if str(ROOT / "benchmarks") not in sys.path:  # a script imports its neighbours, as it does when run
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = iu.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_graph_gaps_chains_write_only_their_own_buffers_and_run_on_a_cpu() -> None:
    """What graph_gap.py captures on the GPU: each chain runs again and again on buffers it made (no host read, no
    new shape), the layer-like chain's kernels differing from each other."""
    from bcg.emulation import EmulatedGraph

    chains = _script_module("graph_gap").chains(8, "cpu")
    assert set(chains) == {"add x1", "layer-like", "gemms"}
    for fn in chains.values():
        fn()
        graph = EmulatedGraph()  # refuses what a CUDA capture would (host reads, data-dependent shapes)
        graph.capture_begin()
        fn()
        graph.capture_end()
        graph.replay()
        assert graph.num_ops > 0


def test_down_partials_split_k_in_place_and_sum_to_the_product() -> None:
    """The batched GEMM down_partials.py times reads the activation and the weight in place (views, no copy) and
    its S partials sum to the projection; without a GPU the script exits 2."""
    module = _script_module("down_partials")
    x, w = torch.randn(5, 12, dtype=torch.float64), torch.randn(7, 12, dtype=torch.float64)
    for splits in (1, 3, 4):
        xs, ws = module.split_views(x, w, splits)
        assert xs.data_ptr() == x.data_ptr() and ws.data_ptr() == w.data_ptr()
        assert torch.allclose(torch.bmm(xs, ws).sum(0), x @ w.T)
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "down_partials.py")], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "needs CUDA" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script measures (the H200 run)")
def test_attention_reads_modes_read_the_same_keys() -> None:
    """Every way of reading keys the benchmark times attends over the same keys (its CPU run: the reference), so
    their times compare one kernel's paths; without a GPU the script itself exits 2."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention_reads

    fns, out = attention_reads.calls(4, 2, 16, 40, device="cpu")
    assert set(fns) == set(attention_reads.MODES)
    fns["direct"]()
    want = out.clone()
    for fn in fns.values():
        out.fill_(float("nan"))
        fn()
        assert torch.equal(out, want)
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_reads.py")], capture_output=True,
                              text=True)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout


def test_graph_nodes_counts_a_dot_dumps_nodes_by_type() -> None:
    """cudaGraphDebugDotPrint's records, the type on the label's first line (or the next): counted by type, edges
    and clusters not; without a GPU the script itself exits 2."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import graph_nodes

    dot = ('digraph dot {\nsubgraph cluster_1 {\nlabel="graph_1" graph[style="dashed"];\n'
           '"graph_1_node_0"[style="bold" shape="record" label="{KERNEL\n| {ID | 0 (topoId: 2) | '
           '_ZN2at6native4add\\<\\<\\<1,128,0\\>\\>\\>}}"];\n'
           '"graph_1_node_1"[style="solid" shape="record" label="{\nMEMCPY\n| {{ID | node handle} | 1}}"];\n'
           '"graph_1_node_2"[style="solid" shape="record" label="{\nMEMSET\n| {ID | 2}}"];\n'
           '"graph_1_node_3"[style="bold" shape="record" label="{KERNEL\n| {ID | 3 | k2}}"];\n'
           '"graph_1_node_0" -> "graph_1_node_1" [headlabel=0];\n}\n}\n')
    assert graph_nodes.node_types(dot) == {"KERNEL": 2, "MEMCPY": 1, "MEMSET": 1}
    assert graph_nodes.non_kernel_nodes(dot) == [
        {"type": "MEMCPY", "after": ["_ZN2at6native4add"], "before": []},
        {"type": "MEMSET", "after": [], "before": []}]
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_nodes.py")], capture_output=True,
                              text=True)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout


def test_graph_gap_refuses_without_a_gpu() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_gap.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_no_script_shadows_an_installed_module() -> None:
    """Running a script puts its folder first on sys.path, and pytest puts every test folder there (they are no
    packages), so a module there named like an installed package replaces it for every import made after:
    transformers 5.25 imports the ``kernels`` package when it makes a model and found a ``benchmarks/kernels.py``."""
    from importlib.machinery import PathFinder

    folders = {ROOT / "benchmarks", ROOT / "scripts", ROOT} | {f.parent for f in (ROOT / "tests").rglob("*.py")}
    ours = {os.fspath(f) for f in folders}
    elsewhere = [p for p in sys.path if p and os.path.abspath(p) not in ours]
    stems = {f.stem for folder in folders for f in folder.glob("*.py")} - {"conftest"}
    assert "fused_ops" in stems and "interpreter" in stems  # the scripts and the test helpers are looked at
    shadowed = sorted(s for s in stems if s in sys.stdlib_module_names or PathFinder.find_spec(s, elsewhere))
    assert not shadowed, f"rename these modules: an installed or standard module has their name: {shadowed}"


def test_prefill_host_smoke() -> None:
    result = run_script("prefill_host.py", "--runs", "3")
    assert [row["forwards"] for row in result["rows"]] == [1, 1, 1, 4]
    launch = {(row["mode"], row["prompts"]): row for row in result["launch"]}
    assert set(launch) == {(mode, n) for mode in ("warm", "cold") for n in (1, 4)}
    # Every case replayed its bucket's whole-step graph, and the replay was called before prefill returned.
    assert all(row["ran"] == "graph_full" and 0 < row["us_to_replay"] < row["us_per_call"] for row in launch.values())


def test_pytest_shards_runs_every_selected_test_once_and_reports_failures(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_a.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(4))\n"
                                     "def test_a(i):\n    print('ran a', i)\n")
    (suite / "test_b.py").write_text("def test_b_fails():\n    assert 1 == 2\n\ndef test_b_ok():\n    pass\n")
    (suite / "test_c.py").write_text("import pytest\n\n@pytest.mark.skip\ndef test_c():\n    pass\n")
    logs = tmp_path / "logs"
    cmd = [sys.executable, str(ROOT / "scripts" / "pytest_shards.py"), "--shards", "2", "--logs", str(logs), "--",
           "-q", "-rf", "-p", "no:cacheprovider", "suite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the failing test's status, not the passing shard's
    # Seven tests in two runs of consecutive ones: test_a.py's four, then test_b.py's two and test_c.py's one.
    assert "shard 0 (4 tests) rc=0: 4 passed in" in proc.stdout
    assert "shard 1 (3 tests) rc=1: 1 failed, 1 passed, 1 skipped in" in proc.stdout
    assert "  FAILED suite/test_b.py::test_b_fails" in proc.stdout
    assert sorted(p.name for p in logs.iterdir()) == ["shard-0.log", "shard-1.log"]
    assert "test_b" not in (logs / "shard-0.log").read_text()  # each test in one shard only
    one = subprocess.run([*cmd[:3], "1", *cmd[4:]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert one.returncode == 1 and "shard 0 rc=1: 1 failed, 5 passed, 1 skipped in" in one.stdout  # plain pytest
