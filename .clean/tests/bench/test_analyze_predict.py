"""The prediction arithmetic of `bcg analyze` on synthetic profiles whose answers are worked out by hand: parsing
profiler events, cutting a forward at its islands, playing programs on two clocks, each backend's program, fusion,
availability, and the graph-memory and build estimates."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from analyze_cases import costs, event, host, layer_trace, profiled

from bcg.bench import predict
from bcg.bench.forecast import ForecastContext, availability, forecast, island_group
from bcg.bench.predict import Launch, fuse, simulate
from bcg.bench.trace import ForwardTrace, IslandCall, Kernel, island_label, kernels_from_events, regions
from bcg.bench.variants import parse_variant

# ---------------------------------------------------------------------------------------------- trace parsing


def test_cuda_kernels_are_matched_to_their_launch_and_island_by_correlation_id() -> None:
    events = [
        event("aten::mm", "CPU", 0, 10, id_=100),
        event("cudaLaunchKernel", "CPU", 2, 4, id_=1),
        event(island_label("attention_island", 0), "CPU", 20, 40),
        event("aten::_flash_attention_forward", "CPU", 22, 30, id_=101),
        event("cudaLaunchKernel", "CPU", 25, 27, id_=2),
        event("aten::copy_", "CPU", 45, 48, id_=102),
        event("cuLaunchKernel", "CPU", 50, 51, id_=3),  # a Triton kernel: no aten op around its launch
        event("cudaGraphLaunch", "CPU", 60, 61, id_=4),  # not a kernel launch
        # device side (its clock runs later); kernel 2 started before kernel 3 although listed after it
        event("sm90_gemm", "CUDA", 100, 110, id_=1),
        event("triton_rms", "CUDA", 140, 143, id_=3),
        event("flash_fwd", "CUDA", 120, 128, id_=2),
        event("Memcpy HtoD (Pinned -> Device)", "CUDA", 150, 151, id_=9, linked=102),  # launch not recorded
        event(island_label("attention_island", 0), "CUDA", 119, 129),  # kineto's GPU-side range: no kernel
    ]
    trace = kernels_from_events(events, cuda=True)
    # in launch order (host clock): the copy has no launch event, so its op's start places it
    assert [(k.name, k.op, k.island, k.device_us) for k in trace.kernels] == [
        ("sm90_gemm", "aten::mm", None, 10),
        ("flash_fwd", "aten::_flash_attention_forward", "attention_island#0", 8),
        ("Memcpy HtoD (Pinned -> Device)", "aten::copy_", None, 1),
        ("triton_rms", "", None, 3),
    ]
    assert trace.kernels[2].is_copy and not trace.kernels[0].is_copy
    assert trace.calls == [IslandCall("attention_island", 0, 20)]


def test_cpu_kernels_are_the_leaf_ops_that_compute() -> None:
    events = [
        event("aten::linear", "CPU", 0, 10),
        event("aten::t", "CPU", 1, 2),  # a view: no kernel
        event("aten::mm", "CPU", 3, 9),
        event("aten::resolve_conj", "CPU", 4, 5),  # a child that computes nothing: mm stays a kernel
        event(island_label("attention_island", 0), "CPU", 12, 30),
        event("aten::scaled_dot_product_attention", "CPU", 13, 29),
        event("aten::_scaled_dot_product_flash_attention_for_cpu", "CPU", 14, 28),
        event("aten::empty", "CPU", 15, 16),
        event("aten::add", "CPU", 40, 42, thread=7),  # another thread's op: not this forward's
    ]
    trace = kernels_from_events(events, cuda=False)
    assert [(k.name, k.device_us, k.island) for k in trace.kernels] == [
        ("aten::mm", 6, None), ("aten::_scaled_dot_product_flash_attention_for_cpu", 14, "attention_island#0")]


def test_regions_cut_at_every_island_call_even_one_that_launched_nothing() -> None:
    mm = Kernel("mm", "aten::mm", 5.0, host_us=1)
    trace = ForwardTrace([mm, Kernel("mm", "aten::mm", 5.0, host_us=30)],
                         [IslandCall("host_only", 0, start_us=10), IslandCall("host_only", 1, start_us=20)])
    rs = regions(trace)
    assert [(r.island.label if r.island else None, len(r.kernels)) for r in rs] == [
        (None, 1), ("host_only#0", 0), ("host_only#1", 0), (None, 1)]


# ---------------------------------------------------------------------------------------------- the two clocks


def test_simulate_host_bound_and_device_bound() -> None:
    eager = [Launch("k", 10.0, 2.0, True) for _ in range(10)]
    assert simulate(eager).wall_us == pytest.approx(102.0)  # the host's launches, then the last kernel
    graph = [Launch("g", 5.0, 100.0, True)]
    assert simulate(graph).wall_us == pytest.approx(105.0)  # the device's work after one launch
    played = simulate([Launch("a", 3.0), *graph])
    assert played.parts["a"] == {"host_us": 3.0, "device_us": 0.0, "count": 1, "nodes": 0}
    with pytest.raises(ValueError, match="negative"):
        simulate([Launch("x", -1.0)])


def test_breakable_program_by_hand() -> None:
    # outside: 500 us of the engine's prefill work + 20 us load, then the 1 us upload; three segments (graph kernels
    # 1 us faster than eager, a 5 us launch each), two islands (3 us break + 30 us host, then their 8 us kernel).
    played = simulate(predict.breakable_program(layer_trace(), host(), costs()))
    assert played.wall_us == pytest.approx(658.0)
    assert played.host_us == pytest.approx(601.0)
    assert played.device_us == pytest.approx(124.0)
    assert played.parts["segment"]["count"] == 3 and played.parts["segment"]["nodes"] == 15
    assert played.parts["island:attention_island"]["host_us"] == pytest.approx(2 * (3 + 30))


def test_full_program_is_one_launch_of_every_kernel() -> None:
    p = profiled()
    played = simulate(predict.full_program(p.full_trace, p.host, costs()))
    assert played.wall_us == pytest.approx(651.0)
    assert played.parts["graph"]["count"] == 1 and played.parts["graph"]["nodes"] == 17


def test_tc_piecewise_program_pays_guards_piece_calls_and_eager_kv_writes() -> None:
    played = simulate(predict.tc_piecewise_program(layer_trace(), host(), costs(), num_params=10))
    assert played.wall_us == pytest.approx(709.0)
    assert played.parts["guards"]["host_us"] == pytest.approx(25.0)  # 20 us + 0.5 us for each of 10 parameters
    assert played.parts["piece"]["nodes"] == 11  # the four K/V writes left the pieces for the islands
    # each island: a 4 us call, two 10 us K/V-write launches, the island's 30 us
    assert played.parts["island:attention_island"]["host_us"] == pytest.approx(2 * (4 + 20 + 30))


def test_measured_replay_paths_replace_the_primitives_costs() -> None:
    # breakable: a 12 us layer on the real path is the 5 us segment launch plus a 7 us break (not the primitive's 3),
    # and of the path's 40 us per forward beyond its layers and load, the 5 us launch of the segment no layer owns is
    # counted with the segments: 35 us come before the first graph
    paths = costs(path_layer_us={"breakable": 12.0, "tc_piecewise": 60.0},
                  path_fixed_us={"breakable": 40.0, "full": 30.0, "tc_piecewise": 90.0},
                  path_params_per_layer=4.0, path_params_fixed=2.0)
    played = simulate(predict.breakable_program(layer_trace(), host(), paths))
    assert played.parts["island:attention_island"]["host_us"] == pytest.approx(2 * (7 + 30))
    assert played.parts["outside"]["host_us"] == pytest.approx(500 + 20 + 35)
    base = simulate(predict.breakable_program(layer_trace(), host(), costs()))
    assert played.host_us == pytest.approx(base.host_us + 2 * (7 - 3) + 35)
    # tc_piecewise: the 60 us layer less the toy layer's 4 parameters' guards (2 us), the 4 us piece call and the
    # two 10 us K/V-write launches leaves 34 us for the island's call; the guards keep their per-parameter part; of
    # the 90 us per forward, the piece no layer owns (4 us) and the toy's 2 parameters outside its layers (1 us)
    played = simulate(predict.tc_piecewise_program(layer_trace(), host(), paths, num_params=10))
    assert played.parts["island:attention_island"]["host_us"] == pytest.approx(2 * (34 + 20 + 30))
    assert played.parts["guards"]["host_us"] == pytest.approx(0.5 * 10)
    assert played.parts["outside"]["host_us"] == pytest.approx(500 + 20 + 85)
    # full: its 30 us per forward less its graph's 5 us launch
    p = profiled()
    with_path = simulate(predict.full_program(p.full_trace, p.host, paths))
    without = simulate(predict.full_program(p.full_trace, p.host, costs()))
    assert with_path.parts["outside"]["host_us"] == pytest.approx(without.parts["outside"]["host_us"] + 25)


def test_fusion_merges_runs_of_pointwise_kernels_between_matmuls() -> None:
    fused = fuse(layer_trace(num_layers=1).kernels, rest=0.3)
    assert [(k.name, round(k.device_us, 3)) for k in fused] == [
        ("Memcpy HtoD", 1.0), ("fused(1)", 3.0), ("gemm", 20.0), ("fused(3)", 3.6), ("flash_fwd", 8.0),
        ("gemm", 20.0), ("fused(1)", 3.0), ("gemm", 20.0)]
    assert not predict.is_fusible(Kernel("triton_rms", "", 3.0))  # a kernel launched outside any op stays


def test_compiled_segments_run_fused_kernels() -> None:
    slower_graphs = costs(graph_kernel_us=3.0)  # each graph kernel 1 us slower than alone: fewer kernels pay
    fast = simulate(predict.breakable_program(layer_trace(), host(), slower_graphs, compiled=fuse))
    slow = simulate(predict.breakable_program(layer_trace(), host(), slower_graphs))
    assert fast.parts["segment"]["nodes"] < slow.parts["segment"]["nodes"]
    assert fast.device_us < slow.device_us


# ---------------------------------------------------------------------------------------------- availability


@pytest.mark.parametrize("variant, islands, full_error, full_islands, emulated, expected", [
    ("breakable", ["select_topk"], "anything", ["x"], True, None),
    ("full", ["attention_island"], None, [], False, None),
    ("full", ["attention_island"], "UncapturableOpError: no", [], False, "backend 'full' cannot capture this model"),
    ("full", ["attention_island"], None, ["auto_island[model.layers.0.mlp]"], False,
     "the island auto_island[model.layers.*.mlp] would run inside"),
    ("tc_piecewise", ["attention_island"], None, [], False, None),
    ("tc_piecewise", ["attention_island", "sparse_attention"], None, [], False, "sparse_attention is not a split"),
    ("tc_piecewise", ["attention_island"], None, [], True, "tc_compiler='inductor' cannot run under the CPU"),
    ("breakable+inductor", ["attention_island", "select_topk"], None, [], False, None),
    ("breakable+inductor", ["attention_island"], None, [], True, "compile='inductor' cannot run under the CPU"),
    ("breakable+traced", ["auto_island[m.experts]"], None, [], True, "cannot trace the island auto_island[m.experts]"),
    ("breakable+fused+full", ["attention_island"], None, [], False, "+full is not predicted"),
])
def test_availability(variant: str, islands: list[str], full_error: str | None, full_islands: list[str],
                      emulated: bool, expected: str | None) -> None:
    why = availability(parse_variant(variant), islands, full_error, full_islands, emulated)
    assert why is None if expected is None else expected in why


def test_island_groups_merge_layers() -> None:
    assert island_group("dsa_attention[model.layers.12.self_attn]") == "dsa_attention[model.layers.*.self_attn]"
    assert island_group("attention_island") == "attention_island"


# ---------------------------------------------------------------------------------------------- forecasts


def _ctx(**changes: float) -> ForecastContext:
    return ForecastContext(costs(**changes), emulated=False, tc_compiler="inductor", num_params=10, warmup=2)


def test_forecast_latency_memory_and_build_by_hand() -> None:
    fc = forecast("breakable", {64: profiled(64)}, _ctx())
    assert fc.available and fc.replay_ms[64] == pytest.approx(0.658)
    assert (fc.nodes[64], fc.graphs[64]) == (15, 3)
    # pool (the 64-token activation peak, 1e6) + 15 nodes x 1 KiB + 3 graphs x 64 KiB
    assert fc.graph_memory_bytes([64], costs()) == pytest.approx(1e6 + 15 * 1024 + 3 * 65536)
    # one more bucket adds its nodes and graphs, not another pool; a larger ceiling scales the pool
    assert fc.graph_memory_bytes([32, 64], costs()) == pytest.approx(1e6 + 2 * (15 * 1024 + 3 * 65536))
    assert fc.graph_memory_bytes([128], costs()) == pytest.approx(2e6 + 15 * 1024 + 3 * 65536)
    # per bucket: 2 warm-up forwards (1.0 ms) + a capture (0.9 ms of host work + 15 x 2 us + 3 x 100 us)
    assert fc.build_ms([64], lambda b: (1.0, 0.9), costs(), warmup=2) == pytest.approx(2.0 + 0.9 + 0.33)


def test_a_compiled_layer_stack_keeps_its_island_crossing_outputs_per_bucket_as_pieces_do() -> None:
    ctx = _ctx(compile_ms={"inductor": (100.0, 2.0)})
    compiled = forecast("breakable+inductor", {64: profiled(64)}, ctx)
    assert compiled.piece_bytes_per_token == pytest.approx(2000.0)  # what tc_piecewise's pieces keep (below)
    assert forecast("breakable", {64: profiled(64)}, _ctx()).piece_bytes_per_token == 0.0  # one set of bridges


def test_forecast_of_tc_piecewise_keeps_piece_outputs_and_compiles() -> None:
    fc = forecast("tc_piecewise", {64: profiled(64)}, _ctx(compile_ms={"inductor": (100.0, 2.0)}))
    breakable = forecast("breakable", {64: profiled(64)}, _ctx())
    assert fc.piece_bytes_per_token == pytest.approx(2000.0)  # 64 000 bytes per call, two calls, 64 tokens
    extra = fc.graph_memory_bytes([32, 64], costs()) - breakable.graph_memory_bytes([32, 64], costs())
    # minus, per bucket, the nodes its pieces hold fewer: the four K/V writes moved to the islands, and Inductor fusing
    # the add and the norm between two matmuls
    assert extra == pytest.approx(2000.0 * 96 - 2 * 5 * 1024, rel=1e-6)
    assert fc.compile_ms == pytest.approx(100.0 + 2.0 * 18)  # one compile's fixed cost, 18 kernels in the forward


def test_unavailable_forecast_has_no_latency_and_no_memory() -> None:
    p = profiled(64)
    p.full_trace, p.full_error = None, "UncapturableOpError: the indexer reads the live batch"
    fc = forecast("full", {64: p}, _ctx())
    assert not fc.available and "indexer" in fc.reason and fc.replay_ms == {}
    assert fc.graph_memory_bytes([64], costs()) == 0.0


def test_forecast_interpolates_between_profiled_sizes() -> None:
    fc = forecast("breakable", {64: profiled(64), 128: profiled(128, mm_us=60.0)}, _ctx())
    low, high = fc.replay_ms[64], fc.replay_ms[128]
    assert high > low and fc.replay_at(96) == pytest.approx((low + high) / 2)
    assert fc.replay_at(16) == pytest.approx(low)  # flat below the first size


def test_the_engines_work_after_the_forward_hides_behind_a_busy_device() -> None:
    p = profiled()
    split = host()
    split.prefill_pre_us, split.prefill_post_us = 400.0, 100.0  # the 500 us of the prefill, measured apart
    played = simulate(predict.full_program(p.full_trace, split, costs()))
    # 400 + 25 us before, a 5 us launch, 121 us of graph: the 100 us after run while the device still works
    assert played.wall_us == pytest.approx(551.0) and played.host_us == pytest.approx(530.0)
    split.prefill_post_us = 300.0  # longer than what the device has left: the host is last
    assert simulate(predict.full_program(p.full_trace, split, costs())).wall_us == pytest.approx(730.0)


def test_the_graph_gap_is_interpolated_between_a_tiny_and_a_medium_kernel() -> None:
    c = costs(medium_kernel_us=10.0, graph_medium_kernel_us=10.0)  # tiny: 2 us alone, 1 in a graph; medium: no gap
    assert c.graph_gap(2.0) == pytest.approx(-1.0) and c.graph_gap(1.0) == pytest.approx(-1.0)
    assert c.graph_gap(6.0) == pytest.approx(-0.5) and c.graph_gap(50.0) == pytest.approx(0.0)
    assert costs().graph_gap(50.0) == pytest.approx(-1.0)  # without the medium kernel: the tiny one's gap


def test_the_mixed_chains_gap_is_every_kernels_gap_where_measured() -> None:
    # 10 kernels summing 40 us eagerly, 45 us a call in a graph: 0.5 us a kernel, whatever a kernel's size
    c = costs(medium_kernel_us=10.0, graph_medium_kernel_us=10.0, graph_chain_us=45.0, chain_kernel_us=40.0,
              chain_kernels=10.0)
    assert c.chain_gap_us == pytest.approx(0.5)
    assert [c.graph_gap(us) for us in (1.0, 6.0, 50.0)] == pytest.approx([0.5, 0.5, 0.5])
    assert costs(graph_chain_us=45.0).chain_gap_us is None  # a run that measured no chain: the add probes decide
    assert costs(graph_chain_us=45.0).graph_gap(50.0) == pytest.approx(-1.0)
    # a segment of three 10 us kernels: 31.5 us in the graph
    k = [Kernel("mm", "aten::mm", 10.0)] * 3
    assert predict._graph("segment", k, c, 5.0).device_us == pytest.approx(31.5)


def test_a_triton_kernels_gap_is_the_fused_chains_beyond_its_other_kernels() -> None:
    # the mixed chain: 0.5 us a kernel; the fused chain: 4 kernels (2 Triton) of 15 us alone, 20 in a graph, so
    # each Triton kernel takes (20 - 15 - 2 * 0.5) / 2 = 2 us beyond its eager time
    c = costs(graph_chain_us=45.0, chain_kernel_us=40.0, chain_kernels=10.0, graph_fused_chain_us=20.0,
              fused_chain_kernel_us=15.0, fused_chain_kernels=4.0, fused_chain_triton=2.0)
    assert c.triton_gap(3.0) == pytest.approx(2.0) and c.graph_gap(3.0) == pytest.approx(0.5)
    ks = [Kernel("nvjet_gemm", "aten::mm", 10.0), Kernel("_rms_norm_kernel", "", 3.0),
          Kernel("Memcpy DtoD", "", 1.0, is_copy=True)]
    assert [k.is_triton for k in ks] == [False, True, False]
    assert predict._graph("segment", ks, c, 5.0).device_us == pytest.approx(10.5 + 5.0 + 1.5)
    # a chain that ran no Triton kernel (the CPU, no Triton) says nothing of them: the others' gap stands
    assert replace(c, fused_chain_triton=0.0).triton_gap(3.0) == pytest.approx(0.5)
    assert costs(graph_chain_us=45.0, chain_kernel_us=40.0, chain_kernels=10.0).triton_gap(3.0) == pytest.approx(0.5)


def test_every_graph_launched_after_eager_work_pays_the_segment_start_on_the_device() -> None:
    c = costs(graph_chain_us=45.0, chain_kernel_us=40.0, chain_kernels=10.0, segment_start_us=4.0)
    ks = [Kernel("mm", "aten::mm", 10.0)] * 3
    assert predict._graph("segment", ks, c, 5.0).device_us == pytest.approx(4.0 + 31.5)
    # a breakable program pays it once per segment, on the device only: the host's launches are unchanged
    trace = layer_trace(num_layers=3)
    plain, started = (predict.breakable_program(trace, host(calls=3), x)
                      for x in (replace(c, segment_start_us=0.0), c))
    segments = [s for s in started if s.part == "segment"]
    assert len(segments) >= 3
    assert sum(s.device_us for s in started) - sum(s.device_us for s in plain) == pytest.approx(4.0 * len(segments))
    assert [s.host_us for s in started] == [s.host_us for s in plain]


def test_the_machine_measures_a_segments_start_with_the_device_the_slower_clock() -> None:
    from bcg.bench.machine import measure
    from bcg.bench.machine_probes import segment_starts, wall_us

    broken, whole = segment_starts(True, None)  # the emulation: both replays run, the same kernels
    assert wall_us(broken, torch.device("cpu")) > 0 and wall_us(whole, torch.device("cpu")) > 0
    assert measure("cpu", cache=False).segment_start_us >= 0


def test_the_machine_measures_the_fused_chain_alone_and_in_a_graph() -> None:
    from bcg.bench.machine import DEVICE_FIELDS, measure, measure_device

    c = measure_device(measure("cpu", cache=False), cache=False)
    assert c.graph_fused_chain_us > 0 and c.fused_chain_kernel_us > 0 and "fused_chain_kernel_us" in DEVICE_FIELDS
    assert c.fused_chain_kernels >= 4  # the GEMM, and the fused kernels' plain-torch references' ops
    assert c.fused_chain_triton == 0 and c.triton_gap(2.0) == c.graph_gap(2.0)  # a CPU runs no Triton kernel


def test_the_machine_measures_the_mixed_chain_alone_and_in_a_graph() -> None:
    from bcg.bench.machine import DEVICE_FIELDS, measure, measure_device

    c = measure_device(measure("cpu", cache=False), cache=False)
    assert c.graph_chain_us > 0 and c.chain_kernel_us > 0
    assert c.chain_kernels >= 6  # a GEMM, an add, the norm's ops, SiLU and the multiply: different ops in turn
    assert c.chain_gap_us == pytest.approx((c.graph_chain_us - c.chain_kernel_us) / c.chain_kernels)
    again = measure_device(measure("cpu"))  # the process's own measurement, device fields included
    assert {f: getattr(again, f) for f in DEVICE_FIELDS} == {f: getattr(c, f) for f in DEVICE_FIELDS}


def test_several_profiles_combine_per_kernel_and_an_odd_one_is_left_out() -> None:
    from bcg.bench.trace import combine_traces

    def trace(*us: float, extra: bool = False) -> ForwardTrace:
        ks = [Kernel("gemm", "aten::mm", us[0]), Kernel("add", "aten::add", us[1])]
        return ForwardTrace(ks + ([Kernel("Memset", "", 50.0, is_copy=True)] if extra else []))

    mid, low, high = combine_traces([trace(10, 2), trace(12, 1), trace(30, 3), trace(99, 99, extra=True)])
    assert [k.device_us for k in mid.kernels] == [12, 2]  # the odd profile (an extra memset) decides nothing
    assert [k.device_us for k in low.kernels] == [10, 1] and [k.device_us for k in high.kernels] == [30, 3]
    assert [k.name for k in mid.kernels] == ["gemm", "add"]


def test_a_forecasts_interval_comes_from_the_spread_of_its_inputs() -> None:
    from dataclasses import replace

    p = profiled(512)
    slow = layer_trace(mm_us=40.0)
    p = replace(p, trace_low=p.trace, trace_high=slow,
                host=replace(p.host, low=p.host, high=replace(p.host, island_us={"attention_island": 50.0})))
    fc = forecast("breakable", {512: p}, ForecastContext(costs(), False, "inductor", 10))
    low, high = fc.interval_at(512)
    assert low == pytest.approx(fc.replay_at(512)) and high > fc.replay_at(512)
    bare = forecast("breakable", {512: profiled(512)}, ForecastContext(costs(), False, "inductor", 10))
    assert bare.interval_at(512) == (bare.replay_at(512), bare.replay_at(512))  # one measurement: no spread


def test_islands_are_predicted_at_the_host_cost_a_replay_pays():
    """An island's host µs per call: the least measured at its size or a longer one, over the kernel settings (the
    same code; an eager forward of Triton launches slows it), the quartile bounds settled apart."""
    from dataclasses import replace

    def timed(n, us, low_us):
        h = host(n, island_us=us)
        return replace(h, low=host(n, island_us=low_us), high=None)

    hosts = {"torch": {64: timed(64, 90.0, 60.0), 128: timed(128, 50.0, 45.0), 256: timed(256, 55.0, 50.0)},
             "fused": {64: timed(64, 95.0, 70.0), 128: timed(128, 85.0, 40.0), 256: timed(256, 80.0, 52.0)}}
    settled = predict.replay_islands(hosts)
    got = {s: {n: h.island_us["attention_island"] for n, h in sizes.items()} for s, sizes in settled.items()}
    assert got == {"torch": {64: 50.0, 128: 50.0, 256: 55.0}, "fused": {64: 50.0, 128: 50.0, 256: 55.0}}
    lows = {n: h.low.island_us["attention_island"] for n, h in settled["fused"].items()}
    assert lows == {64: 40.0, 128: 40.0, 256: 50.0} and settled["fused"][64].high is None
    assert hosts["fused"][64].island_us["attention_island"] == 95.0  # the measurements themselves are kept
    assert settled["fused"][64].forward_ms == hosts["fused"][64].forward_ms  # only the islands change
    # an island whose kernels differ by setting (other code: glm-dsa's select_topk) keeps its own setting's times
    own = predict.replay_islands(hosts, own={"attention_island"})
    assert {n: h.island_us["attention_island"] for n, h in own["fused"].items()} == {64: 80.0, 128: 80.0, 256: 80.0}
    assert {n: h.island_us["attention_island"] for n, h in own["torch"].items()} == {64: 50.0, 128: 50.0, 256: 55.0}


def test_an_island_is_its_settings_own_where_its_kernels_differ():
    def trace(topk_kernels):
        ks = [Kernel("mm", "aten::mm", 5.0, host_us=1), Kernel("flash", "aten::sdpa", 3.0, "attention_island#0", 11),
              *[Kernel(n, "", 2.0, "select_topk#1", 21) for n in topk_kernels],
              Kernel("mm", "aten::mm", 5.0, host_us=30)]
        return ForwardTrace(ks, [IslandCall("attention_island", 0, 10), IslandCall("select_topk", 1, 20)])

    torch_trace, fused_trace = trace(["topk", "gather", "scatter"]), trace(["bcg_topk_kernel"])
    assert predict.islands_by_setting({"torch": torch_trace, "fused": fused_trace}) == {"select_topk"}
    assert predict.islands_by_setting({"torch": torch_trace, "fused": torch_trace}) == set()
