"""An MLP's activation and down projection: one Triton kernel (``swiglu_down``) against the two steps it replaces.

The two steps are bcg's SiLU-and-multiply kernel and cuBLAS's ``F.linear`` (which at short prompts splits K and adds a
reduce kernel); the one kernel computes the activation as it loads the GEMM's operand and sums its K splits itself
(``bcg/ops/kernels/triton_down_proj.py``). For the down projections of the llama-dense, Llama-3.2-1B and Qwen3-0.6B
layers (bf16) at each row count: the kernels one call launches, and the device time per call inside a CUDA graph
(``--calls`` calls captured back to back, the graph replayed ``--replays`` times between CUDA events: what a
segment's replay pays, the in-graph gaps between kernels included), the one kernel's largest difference from the
two steps, and the rows up to which the entry point runs it (``MAX_FUSED_ROWS``). The last line printed is one JSON
object (``--out`` too).

Usage::

    python benchmarks/down_proj.py --rows 16,32,64,128,256,512 --out down_proj.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# model -> (hidden, intermediate): the down projection is (intermediate -> hidden)
SHAPES = {"llama-dense": (1024, 2816), "llama-3.2-1b": (2048, 8192), "qwen3-0.6b": (1024, 3072)}


def graph_us(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Device µs per call of ``fn``: ``calls`` captured in one graph, replayed ``replays`` times between events."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def kernel_names(fn: Callable[[], object]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def measure(rows_list: list[int], calls: int, replays: int) -> list[dict]:
    from bcg.ops import kernels
    from bcg.ops.kernels import down_proj, triton_down_proj

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model, (hidden, inter) in SHAPES.items():
        w = (torch.randn(hidden, inter, device="cuda", generator=gen) * inter**-0.5).to(torch.bfloat16)
        for rows in rows_list:
            x = torch.randn(rows, 2 * inter, device="cuda", generator=gen).to(torch.bfloat16)
            plan = triton_down_proj.tiling(rows, hidden, inter, num_sms)
            out = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
            partials = torch.empty(max(1, plan.split_k * rows * hidden), device="cuda")
            counters = torch.zeros(plan.tiles, dtype=torch.int32, device="cuda")

            def two_steps() -> torch.Tensor:
                return F.linear(kernels.silu_and_mul(x), w)

            def one_kernel() -> torch.Tensor:  # the launcher itself: every row count, past MAX_FUSED_ROWS too
                triton_down_proj.swiglu_down(x, w, out, partials, counters, plan)
                return out

            ref = two_steps()
            one_kernel()
            diff = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            row = {"model": model, "rows": rows, "hidden": hidden, "intermediate": inter,
                   "tiling": plan._asdict(), "max_rel_diff": diff,
                   "entry_point_fuses": rows <= down_proj.MAX_FUSED_ROWS}
            for name, fn in (("two_steps", two_steps), ("one_kernel", one_kernel)):
                row[f"{name}_us"] = graph_us(fn, calls, replays)
                row[f"{name}_kernels"] = kernel_names(fn)
            row["ratio"] = row["one_kernel_us"] / row["two_steps_us"]
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,32,64,128,256,512", help="row counts, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=20, help="replays timed")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("down_proj.py measures CUDA kernels and needs a GPU", file=sys.stderr)
        return 2
    from bcg.ops.kernels import down_proj

    results = measure([int(r) for r in args.rows.split(",")], args.calls, args.replays)
    print(f"{'model':<13} {'rows':>5} {'two steps us':>13} {'kernels':>8} {'one kernel us':>14} {'ratio':>6} "
          f"{'split_k':>7} {'max rel diff':>13}")
    for r in results:
        print(f"{r['model']:<13} {r['rows']:>5} {r['two_steps_us']:>13.2f} {len(r['two_steps_kernels']):>8} "
              f"{r['one_kernel_us']:>14.2f} {r['ratio']:>6.2f} {r['tiling']['split_k']:>7} {r['max_rel_diff']:>13.2e}")
    report = {"kind": "down_proj", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "max_fused_rows": down_proj.MAX_FUSED_ROWS, "results": results}
    text = json.dumps(report)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
