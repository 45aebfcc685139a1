"""The CUDA tier of `bcg analyze`: the profiler's kernels attributed to their island calls and ops, this machine's
costs measured, and a validated run whose availability predictions agree with the builds. Structure only: the
prediction error targets are benchmarks (scripts/analyze_evidence.sh), not tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bcg.cli import main

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_profiled_forward_finds_kernels_islands_and_the_full_step() -> None:
    from bcg.bench.engines import EngineSpec, engine_for
    from bcg.bench.profile import host_times
    from bcg.bench.profiled import profile_sizes
    from bcg.bench.trace import regions
    from bcg.bench.validate import prompt_for
    from bcg.runtime.config import EngineConfig

    spec = EngineSpec("tiny-dense", EngineConfig(device="cuda", chunked_prefill_size=64, progress=False))
    with engine_for(spec, "eager") as eng:
        prompts = {n: prompt_for(eng.model.config.vocab_size, n, 0) for n in (16, 32)}
        hosts = {n: host_times(eng, prompt, runs=3, warmup=1) for n, prompt in prompts.items()}
        ps = profile_sizes(eng, prompts, hosts)  # both sizes in one profiler session
    host, p = hosts[32], ps[32]
    # Each size its own trace of the same kernels (their device times are too close on this model to order: the
    # H200 once measured 16 tokens 4% slower than 32).
    assert (ps[16].size, p.size) == (16, 32) and ps[16].trace is not p.trace
    assert len(ps[16].trace.kernels) == len(p.trace.kernels) and min(ps[16].trace.device_us, p.trace.device_us) > 0
    assert host.island_calls == {"attention_island": 2} and host.island_us["attention_island"] > 0
    assert len(p.trace.calls) == 2
    rs = regions(p.trace)
    islands = [r for r in rs if r.island is not None]
    assert len(islands) == 2 and all(r.kernels for r in islands)  # each island launched its attention kernel
    graph = [k for r in rs if r.island is None for k in r.kernels]
    assert sum(k.op == "aten::mm" or "gemm" in k.name.lower() for k in graph) >= 7  # 3 matmuls a layer, the head
    assert all(k.device_us > 0 for k in p.trace.kernels)
    assert p.full_error is None and p.full_trace is not None and not p.full_trace.calls
    assert p.activation_bytes and p.activation_bytes > 0
    # two or three profiles per size: each kernel's median with its range, the host times' quartiles around their
    # median
    assert p.profiles in (2, 3) and p.trace_low is not None and p.trace_high is not None
    for lo, mid, hi in zip(p.trace_low.kernels, p.trace.kernels, p.trace_high.kernels):
        assert lo.name == mid.name == hi.name and lo.device_us <= mid.device_us <= hi.device_us
    assert host.low is not None and host.high is not None
    assert host.low.forward_ms <= host.forward_ms <= host.high.forward_ms


def test_machine_costs_on_cuda() -> None:
    from bcg.bench import machine

    costs = machine.measure_device(machine.measure("cuda", compilers=(), guards=True))
    for name in ("eager_launch_us", "eager_kernel_us", "graph_kernel_us", "graph_launch_us", "piece_us",
                 "capture_per_graph_us", "tiny_kernel_us"):
        value = getattr(costs, name)
        assert value is not None and math.isfinite(value) and value > 0, name
    assert costs.graph_node_bytes >= 0 and costs.graph_bytes >= 0 and not costs.emulated
    # the fused chain ran bcg's two Triton kernels a call beside its GEMM (one or two cuBLAS kernels)
    assert costs.fused_chain_triton == 2 and 3 <= costs.fused_chain_kernels <= 4
    assert costs.graph_fused_chain_us > 0 and math.isfinite(costs.triton_gap(2.0))
    assert 0 <= costs.segment_start_us < 50  # a few µs a segment launched after an island's kernel


def test_validated_analyze_agrees_on_availability(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["analyze", "--device", "cuda", "--model", "tiny-dense", "--runs", "3", "--warmup", "1",
               "--no-progress", "--chunked-prefill-size", "64", "--predict-lengths", "16,64", "--length", "32",
               "--lengths", "8,40,100", "--backends", "breakable,breakable+fused,full", "--validate",
               "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    data = json.loads((tmp_path / "results.json").read_text())
    for v in ("breakable", "breakable+fused", "full"):
        assert data["validation"][v]["available"] == data["validation"][v]["predicted_available"] is True
        assert set(summary["errors"][v]) == {"16", "32", "64"}
    assert set(data["predictions"]) >= {"eager", "eager+fused"}
    assert data["machine"]["None"]["tiny_kernel_us"] > 0 and data["memory"]["free_bytes"] > 0
    assert data["parameters"]["launch_gap_share"] is not None


def test_replay_paths_on_cuda() -> None:
    from bcg.bench.paths import measure_paths

    paths = measure_paths("cuda", ("breakable", "tc_piecewise"), cache=False)
    assert paths.errors == {} and set(paths.per_layer_us) == {"breakable", "tc_piecewise"}
    assert paths.island_us > 0  # the attention island's own host time on the eager toy
    # Host timings of toy engines on a shared machine: which backend's layer costs more is a measurement for the
    # benchmarks, not an assertion (it flipped between two H200 runs); what holds by construction is checked here:
    # a layer costs the host something, and what is left beyond the island is the whole less the island, at least 0.
    for backend in ("breakable", "tc_piecewise"):
        total, beyond = paths.layer_total_us[backend], paths.per_layer_us[backend]
        assert total > 0 and beyond >= 0 and abs(beyond - max(total - paths.island_us, 0.0)) < 1e-6
