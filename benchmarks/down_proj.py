"""An MLP's activation and down projection: one Triton kernel (``swiglu_down``) against the two steps it replaces.

The two steps are bcg's SiLU-and-multiply kernel and cuBLAS's ``F.linear`` (which at short prompts splits K and adds a
reduce kernel); the one kernel computes the activation as it loads the GEMM's operand and sums its K splits itself
(``bcg/ops/kernels/triton_down_proj.py``). For the down projections of the llama-dense, Llama-3.2-1B and Qwen3-0.6B
layers (bf16) at each row count: the kernels one call launches, and the device time per call inside a CUDA graph
(``--calls`` calls captured back to back, the graph replayed ``--replays`` times between CUDA events: what a
segment's replay pays, the in-graph gaps between kernels included), the one kernel's largest difference from the
two steps, and the rows up to which the entry point runs it (``MAX_FUSED_ROWS``). The last line printed is one JSON
object (``--out`` too).

With ``--sweep`` it times the one kernel under other tilings too (block sizes, K splits, pipeline depths, warps) at
the short prompts, beside a plain split-K GEMM of the same tiles without the activation (a kernel of this file), and
records what Triton compiled on this machine for each (registers, spills, shared memory): the tiling rule of
``triton_down_proj.tiling`` is chosen from that table.

Usage::

    python benchmarks/down_proj.py --rows 16,32,64,128,256,512 --out down_proj.json
    python benchmarks/down_proj.py --sweep --rows 16,64,128 --out down_proj_sweep.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: the checkout's bcg, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bcg.ops.kernels import silu_and_mul

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

            two_steps = functools.partial(two_step_call, x, w)

            # The launcher itself: every row count, past MAX_FUSED_ROWS too.
            one_kernel = functools.partial(triton_down_proj.swiglu_down, x, w, out, partials, counters, plan)
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


def compiled_facts(kernel: object) -> dict:
    """What Triton compiled: registers a thread, bytes spilled, shared memory, and whether the loads are pipelined
    (cp.async) and the products on Hopper's wgmma."""
    ptx = kernel.asm.get("ptx", "")
    return {"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
            "shared": kernel.metadata.shared, "cp_async": ptx.count("cp.async.cg"), "wgmma": ptx.count("wgmma.mma")}


def sweep_variants(rows: int) -> list[dict]:
    """The tilings tried first, at the rule's own K split (all compile for sm_90 without spills). Every output-column
    tile recomputes the activation of its rows, so wider tiles do less of that, but leave fewer tiles and so split K
    more, and every split writes and reads back ``rows x cols`` fp32 partials: the sweep finds the balance."""
    variants: list[dict] = [{}]
    for block_n, block_k, warps, stages in ((128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (256, 32, 8, 4),
                                            (128, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 4), (256, 128, 8, 2)):
        variants.append({"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages})
    variants += [{"block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "programs_per_sm": 1},
                 {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4, "programs_per_sm": 1}]
    if rows < 64:
        variants.append({"block_m": 64})  # wgmma with masked rows
    return variants


def run_variant(case: dict, overrides: dict, swiglu: bool = True) -> dict:
    """One tiling of ``case`` (model, rows, x, w, ref, num_sms, calls, replays): checked, compiled facts, timed."""
    from bcg.ops.kernels import triton_down_proj

    x, w, rows = case["x"], case["w"], case["rows"]
    hidden, inter = w.shape
    plan = triton_down_proj.tiling(rows, hidden, inter, case["num_sms"], **overrides)
    out = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    partials = torch.empty(max(1, plan.split_k * rows * hidden), device="cuda")
    counters = torch.zeros(plan.tiles, dtype=torch.int32, device="cuda")
    operand = x if swiglu else x[:, :inter].contiguous()

    def call() -> object:
        return triton_down_proj.swiglu_down(operand, w, out, partials, counters, plan, swiglu)

    row = {"model": case["model"], "rows": rows, "swiglu": swiglu, "overrides": overrides, "tiling": plan._asdict(),
           **compiled_facts(call())}
    if swiglu:
        row["max_rel_diff"] = float((out.float() - case["ref"]).abs().max() / case["ref"].abs().max())
    row["us"] = graph_us(call, case["calls"], case["replays"])
    print(f"{case['model']:<13} {rows:>4} {'swiglu' if swiglu else 'plain':<6} {row['us']:>8.2f} us  {plan}  "
          f"regs {row['regs']} spills {row['spills']} cp.async {row['cp_async']} wgmma {row['wgmma']}", flush=True)
    return row


def sweep(rows_list: list[int], calls: int, replays: int) -> list[dict]:
    """Per shape: the first variants, then the fastest one's K splits and warps, then the plain split-K matmul of
    the fastest tiling (no activation in the prologue)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model in ("llama-dense", "llama-3.2-1b"):
        hidden, inter = SHAPES[model]
        w = (torch.randn(hidden, inter, device="cuda", generator=gen) * inter**-0.5).to(torch.bfloat16)
        for rows in rows_list:
            x = torch.randn(rows, 2 * inter, device="cuda", generator=gen).to(torch.bfloat16)
            case = {"model": model, "rows": rows, "x": x, "w": w, "num_sms": num_sms, "calls": calls,
                    "replays": replays, "ref": F.linear(F.silu(x[:, :inter]) * x[:, inter:], w).float()}
            two_steps = graph_us(functools.partial(two_step_call, x, w), calls, replays)
            print(f"{model:<13} {rows:>4} two steps {two_steps:.2f} us", flush=True)
            tried = [run_variant(case, v) for v in sweep_variants(rows)]
            best = min(tried, key=lambda r: r["us"])
            auto_split = best["tiling"]["split_k"]
            for split in sorted({1, max(1, auto_split // 2), 2 * auto_split}):
                tried.append(run_variant(case, {**best["overrides"], "split_k": split}))
            tried.append(run_variant(case, {**best["overrides"], "num_warps": 12 - best["tiling"]["num_warps"]}))
            best = min(tried, key=lambda r: r["us"])
            tried.append(run_variant(case, best["overrides"], swiglu=False))
            results.append({"model": model, "rows": rows, "two_steps_us": two_steps, "best": best, "variants": tried})
    return results


def two_step_call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul(x), w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,32,64,128,256,512", help="row counts, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=20, help="replays timed")
    parser.add_argument("--sweep", action="store_true", help="time other tilings too (see the module doc)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("down_proj.py measures CUDA kernels and needs a GPU", file=sys.stderr)
        return 2
    from bcg.ops.kernels import down_proj

    if args.sweep:
        results = sweep([int(r) for r in args.rows.split(",")], args.calls, args.replays)
        for r in results:
            b = r["best"]
            print(f"best {r['model']} {r['rows']}: {b['us']:.2f} us against two steps {r['two_steps_us']:.2f} us "
                  f"with {b['overrides']}")
        report = {"kind": "down_proj_sweep", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "results": results}
        text = json.dumps(report)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
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
