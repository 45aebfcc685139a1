"""benchmarks/device_bound.py's per-kernel view: its counting on known kernels, and its shape on a CPU prefill."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bcg.bench.kernel_view import eager_ops, kernel_view
from bcg.bench.trace import Kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
device_bound = pytest.importorskip("device_bound")


def test_kernel_view_counts_and_ranks_kernels_by_name() -> None:
    kernels = [Kernel("gemm", "aten::mm", 3.0), Kernel("norm", "", 1.0), Kernel("gemm", "aten::mm", 5.0),
               Kernel("copy", "aten::copy_", 1.0, is_copy=True), Kernel("norm", "", 2.0)]
    view = kernel_view(kernels, num_layers=2, eager_ops={"aten::copy_": 1, "aten::mm": 2})
    assert (view["kernels"], view["eager_kernels"], view["kernels_per_layer"], view["eager_per_layer"]) == (5, 3, 2.5,
                                                                                                            1.5)
    assert view["kernel_ms"] == pytest.approx(12e-3)
    assert [(e["name"], e["count"], e["us"]) for e in view["by_name"]] == [("gemm", 2, 8.0), ("norm", 2, 3.0),
                                                                          ("copy", 1, 1.0)]
    assert [e["share"] for e in view["by_name"]] == pytest.approx([8 / 12, 3 / 12, 1 / 12])
    assert view["eager_by_op"] == [{"op": "aten::mm", "count": 2}, {"op": "aten::copy_", "count": 1}]
    assert kernel_view([], num_layers=1, eager_ops={})["by_name"] == []


def test_device_bound_reports_the_kernel_view_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    result = device_bound.measure("tiny-dense", "breakable", [8, 24], runs=1, out=None, timeline=False,
                                  engine_args={"chunked_prefill_size": 256})
    layers = result["num_layers"]
    for row in result["rows"]:
        view = row["kernel_view"]
        counts = [e["count"] for e in view["by_name"]]
        assert view["kernels"] == sum(counts) > 0 and view["kernels_per_layer"] == view["kernels"] / layers
        assert view["eager_kernels"] == view["kernels"]  # a CPU launches every op itself
        assert {e["op"]: e["count"] for e in view["eager_by_op"]} == {e["name"]: e["count"] for e in view["by_name"]}
        assert sum(e["share"] for e in view["by_name"]) == pytest.approx(1.0)
        assert [e["us"] for e in view["by_name"]] == sorted((e["us"] for e in view["by_name"]), reverse=True)
        assert any(e["name"] == "aten::mm" for e in view["by_name"])  # the projections are there by op name
        # The first graph replay is found through the breakable graph too; the device span needs CUDA.
        assert 0 < row["launch_ms"] < row["wall_ms"] and row["span_ms"] is None
    # A one-request prefill of a dense model runs the same ops at every length (the bucket changes shapes only).
    assert result["rows"][0]["kernel_view"]["kernels"] == result["rows"][1]["kernel_view"]["kernels"]
    # The launch's host steps at the shortest length, in the order they ran, the load inside the prefill.
    stages = {st["stage"].strip(): st for st in result["launch_stages"]}
    order = ["validate prompts", "reserve KV slots", "plan the forward", "load the batch"]
    assert [stages[s]["start_us"] for s in order] == sorted(stages[s]["start_us"] for s in order)
    assert stages["prefill"]["us"] > stages["load the batch"]["us"] > 0
    device_bound.print_result(result, top=3)
    printed = capsys.readouterr().out
    assert "k/layer" in printed and printed.count("costliest:") == 2 and "aten::mm x" in printed
    assert "8 tokens, host steps (start+took µs): validate prompts " in printed


def test_full_graph_tokens_sets_which_buckets_run_the_whole_step_graph() -> None:
    result = device_bound.measure("tiny-dense", "breakable+full", [8, 24], runs=1, out=None, timeline=False,
                                  engine_args={"chunked_prefill_size": 256}, full_graph_tokens=16)
    assert [row["ran"] for row in result["rows"]][0] == "graph_full"  # 8 tokens: a bucket of at most 16
    assert result["rows"][1]["ran"] != "graph_full"  # 24 tokens: past the limit, the breakable graphs


def test_eager_launches_are_counted_by_the_op_around_them() -> None:
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name: str, start: float, end: float, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("aten::index", 0, 10), event("cudaLaunchKernel", 2, 3),  # an island's gather
              event("aten::copy_", 20, 30), event("aten::fill_", 21, 25), event("cudaLaunchKernel", 22, 23),
              event("cudaMemcpyAsync", 27, 28),  # the copy's own transfer, after the nested fill
              event("cudaGraphLaunch", 40, 41),  # a replayed segment: not an eager launch
              event("cudaLaunchKernel", 50, 51),  # a Triton kernel launched from Python
              event("void gemm<...>", 60, 70, DeviceType.CUDA)]
    assert eager_ops(events) == {"aten::index": 1, "aten::fill_": 1, "aten::copy_": 1,
                                               "(no aten op)": 1}



def test_buckets_and_overrides_reach_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert device_bound.main(["--models", "tiny-dense+num_layers=1", "--lengths", "8", "--buckets", "8,16",
                              "--runs", "1", "--top-kernels", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"][0]
    assert (result["num_layers"], result["buckets"]) == (1, 2)
    assert "gaps_ms" in result["rows"][0]
