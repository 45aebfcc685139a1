"""A SwiGLU MLP at short prompts under each ``BCG_MLP_FUSION``: SiLU-and-multiply as a kernel of its own, in the
gate/up projection's epilogue, or in the down projection's prologue.

``none`` is cuBLAS's gate/up GEMM, bcg's SiLU-and-multiply kernel and cuBLAS's down GEMM (which at short prompts
splits K and adds a reduce kernel); ``gate_up`` is bcg's gate/up kernel with the activation in its epilogue
(``bcg/ops/kernels/triton_gate_up.py``) and cuBLAS's down GEMM; ``down`` is cuBLAS's gate/up GEMM and bcg's down kernel
with the activation in its prologue (``bcg/ops/kernels/triton_down_proj.py``). For the MLPs of the llama-dense,
Llama-3.2-1B and Qwen3-0.6B layers (bf16) at each row count: the kernels one MLP launches, and its device time inside
a CUDA graph (``--calls`` MLPs captured back to back, the median of ``--replays`` timed replays, divided: what a
segment's replay pays, the in-graph gaps between kernels included; ``benchmarks/fused_ops.py``'s ``graph_us``, which
since 2026-12-03's round 8 replaces this script's own mean over the replays), and each fusion's largest difference
from ``none``. The fused kernels run through their launchers, past the entry points' row limits too.

``--sweep gate_up`` (or ``down``) times one kernel under other tilings at the given row counts (block sizes, K
splits, pipeline depths, warps) and records what Triton compiled for each (registers, spills, shared memory,
cp.async and wgmma): the kernels' tiling rules are chosen from that table. The last line printed is one JSON object
(``--out`` too). (Until 95e9874 this script was ``benchmarks/down_proj.py`` and measured the down kernel alone.)

Usage::

    python benchmarks/mlp_kernels.py --rows 16,32,64,128,256 --out mlp_kernels.json
    python benchmarks/mlp_kernels.py --sweep gate_up --rows 16,64 --out gate_up_sweep.json

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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's fused_ops.py
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the checkout's bcg, not an installed one
from fused_ops import graph_us

from bcg.ops.kernels import silu_and_mul

# model -> (hidden, intermediate)
SHAPES = {"llama-dense": (1024, 2816), "llama-3.2-1b": (2048, 8192), "qwen3-0.6b": (1024, 3072)}
FUSIONS = ("none", "gate_up", "down")


def kernel_names(fn: Callable[[], object]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


class MLP:
    """One MLP's weights and input, and its forward under each fusion (the fused kernels through their launchers,
    their tilings overridable)."""

    def __init__(self, hidden: int, inter: int, rows: int, gen: torch.Generator) -> None:
        from bcg.ops.kernels import triton_down_proj, triton_gate_up  # Triton: imported where a GPU runs them

        self.gate_up_kernel, self.down_kernel = triton_gate_up, triton_down_proj
        self.rows, self.hidden, self.inter = rows, hidden, inter
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.w_gate_up = (torch.randn(2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).bfloat16()
        self.w_down = (torch.randn(hidden, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
        self.x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
        self.gate_up = F.linear(self.x, self.w_gate_up)
        self.act = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
        self.gate_up_plan = triton_gate_up.tiling(rows, inter, self.num_sms)
        self.down_plan(triton_down_proj.tiling(rows, hidden, inter, self.num_sms))

    def down_plan(self, plan: object) -> None:
        self.down = plan
        self.partials = torch.empty(max(1, plan.split_k * self.rows * self.hidden), device="cuda")
        self.counters = torch.zeros(plan.tiles, dtype=torch.int32, device="cuda")

    def none(self) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(self.x, self.w_gate_up)), self.w_down)

    def fused_gate_up(self) -> object:
        return self.gate_up_kernel.gate_up_silu(self.x, self.w_gate_up, self.act, self.gate_up_plan)

    def gate_up_mlp(self) -> torch.Tensor:
        self.fused_gate_up()
        return F.linear(self.act, self.w_down)

    def fused_down(self) -> object:
        return self.down_kernel.swiglu_down(self.gate_up, self.w_down, self.out, self.partials, self.counters,
                                            self.down)

    def down_mlp(self) -> torch.Tensor:
        self.gate_up = F.linear(self.x, self.w_gate_up)
        self.fused_down()
        return self.out

    def forward(self, fusion: str) -> Callable[[], object]:
        return {"none": self.none, "gate_up": self.gate_up_mlp, "down": self.down_mlp}[fusion]


def measure(rows_list: list[int], calls: int, replays: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model, (hidden, inter) in SHAPES.items():
        for rows in rows_list:
            mlp = MLP(hidden, inter, rows, gen)
            ref = mlp.none().float()
            row: dict = {"model": model, "rows": rows, "hidden": hidden, "intermediate": inter,
                         "gate_up_tiling": mlp.gate_up_plan._asdict(), "down_tiling": mlp.down._asdict()}
            for fusion in FUSIONS:
                fn = mlp.forward(fusion)
                got = fn().float()
                row[f"{fusion}_max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
                row[f"{fusion}_us"] = graph_us(fn, calls, replays)
                row[f"{fusion}_kernels"] = kernel_names(fn)
            results.append(row)
    return results


def compiled_facts(kernel: object) -> dict:
    """What Triton compiled: registers a thread, bytes spilled, shared memory, and whether the loads are pipelined
    (cp.async) and the products on Hopper's wgmma."""
    ptx = kernel.asm.get("ptx", "")
    return {"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
            "shared": kernel.metadata.shared, "cp_async": ptx.count("cp.async.cg"), "wgmma": ptx.count("wgmma.mma")}


def sweep_variants(kernel: str, rows: int) -> list[dict]:
    """The tilings tried first (all compile for sm_90 without spills)."""
    variants: list[dict] = [{}]
    if kernel == "gate_up":
        for block_n, block_k, warps, stages in ((16, 64, 4, 4), (32, 64, 4, 4), (32, 64, 4, 3), (32, 128, 4, 3),
                                                (64, 64, 4, 4), (64, 64, 8, 3), (32, 64, 8, 5), (16, 128, 4, 3),
                                                (64, 128, 8, 3)):
            variants.append({"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages})
    else:  # down: wider tiles recompute less of the activation but split K more (fp32 partials per split)
        for block_n, block_k, warps, stages in ((128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (256, 32, 8, 4),
                                                (128, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 4), (256, 128, 8, 2)):
            variants.append({"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages})
        variants += [{"block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "programs_per_sm": 1},
                     {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4, "programs_per_sm": 1}]
    if rows < 64:
        variants.append({"block_m": 64})  # wgmma with masked rows
    return variants


def run_variant(kernel: str, mlp: MLP, ref: torch.Tensor, overrides: dict, calls: int, replays: int) -> dict:
    """One tiling of ``kernel`` on ``mlp``: checked against ``ref``, compiled facts, timed."""
    if kernel == "gate_up":
        mlp.gate_up_plan = plan = mlp.gate_up_kernel.tiling(mlp.rows, mlp.inter, mlp.num_sms, **overrides)
        call, result = mlp.fused_gate_up, mlp.act
    else:
        mlp.down_plan(plan := mlp.down_kernel.tiling(mlp.rows, mlp.hidden, mlp.inter, mlp.num_sms, **overrides))
        call, result = mlp.fused_down, mlp.out
    row = {"rows": mlp.rows, "overrides": overrides, "tiling": plan._asdict(), **compiled_facts(call())}
    row["max_rel_diff"] = float((result.float() - ref).abs().max() / ref.abs().max())
    row["us"] = graph_us(call, calls, replays)
    print(f"{kernel:<8} {mlp.rows:>4} {row['us']:>8.2f} us  {plan}  regs {row['regs']} spills {row['spills']} "
          f"cp.async {row['cp_async']} wgmma {row['wgmma']}", flush=True)
    return row


def sweep(kernel: str, rows_list: list[int], calls: int, replays: int) -> list[dict]:
    """Per shape: the two steps the kernel replaces, the first variants, then the fastest one's K splits (down) or
    warps, each checked against the two steps."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model in ("llama-dense", "llama-3.2-1b"):
        hidden, inter = SHAPES[model]
        for rows in rows_list:
            mlp = MLP(hidden, inter, rows, gen)
            if kernel == "gate_up":
                ref = silu_and_mul(F.linear(mlp.x, mlp.w_gate_up)).float()
                two_steps = graph_us(lambda m=mlp: silu_and_mul(F.linear(m.x, m.w_gate_up)), calls, replays)
            else:
                ref = F.linear(silu_and_mul(mlp.gate_up), mlp.w_down).float()
                two_steps = graph_us(lambda m=mlp: F.linear(silu_and_mul(m.gate_up), m.w_down), calls, replays)
            print(f"{model:<13} {rows:>4} the two steps: {two_steps:.2f} us", flush=True)
            tried = [run_variant(kernel, mlp, ref, v, calls, replays) for v in sweep_variants(kernel, rows)]
            best = min(tried, key=lambda r: r["us"])
            if kernel == "down":
                auto_split = best["tiling"]["split_k"]
                for split in sorted({1, max(1, auto_split // 2), 2 * auto_split}):
                    tried.append(run_variant(kernel, mlp, ref, {**best["overrides"], "split_k": split}, calls,
                                             replays))
            tried.append(run_variant(kernel, mlp, ref, {**best["overrides"],
                                                         "num_warps": 12 - best["tiling"]["num_warps"]},
                                     calls, replays))
            best = min(tried, key=lambda r: r["us"])
            results.append({"model": model, "rows": rows, "two_steps_us": two_steps, "best": best, "variants": tried})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,32,64,128,256", help="row counts, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="MLPs (or kernels) captured in one graph")
    parser.add_argument("--replays", type=int, default=20, help="replays timed")
    parser.add_argument("--sweep", choices=("gate_up", "down"), default=None,
                        help="time this kernel's other tilings (see the module doc)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mlp_kernels.py measures CUDA kernels and needs a GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    if args.sweep:
        results = sweep(args.sweep, rows, args.calls, args.replays)
        for r in results:
            print(f"best {args.sweep} {r['model']} {r['rows']}: {r['best']['us']:.2f} us against the two steps' "
                  f"{r['two_steps_us']:.2f} us, with {r['best']['overrides']}")
        report = {"kind": f"{args.sweep}_sweep", "results": results}
    else:
        results = measure(rows, args.calls, args.replays)
        print(f"{'model':<13} {'rows':>5} " + " ".join(f"{f + ' us':>11} {'kernels':>7}" for f in FUSIONS)
              + f" {'gate_up/none':>12} {'down/none':>9}")
        for r in results:
            cells = " ".join(f"{r[f + '_us']:>11.2f} {len(r[f + '_kernels']):>7}" for f in FUSIONS)
            print(f"{r['model']:<13} {r['rows']:>5} {cells} {r['gate_up_us'] / r['none_us']:>12.2f} "
                  f"{r['down_us'] / r['none_us']:>9.2f}")
        report = {"kind": "mlp_kernels", "results": results}
    report.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    text = json.dumps(report)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
