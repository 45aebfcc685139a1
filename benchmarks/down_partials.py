"""Could the down projection at short prompts leave its split-K partials to the next kernel instead of reducing them?

At 64 tokens cuBLAS splits the down projection's K and adds a reduce kernel (issue 29: one of the 9.4 kernels a layer
on llama-dense). The next kernel, the residual add + RMSNorm, reads the projection's output anyway: if the GEMM wrote
its ``S`` split-K partials in fp32, that kernel could sum them as it reads them and the reduce kernel would go. This
measures the first half: a batched GEMM over ``S`` slices of K (``torch.bmm`` with ``out_dtype=float32``, the
activation and the weight viewed in place, no copy) against ``F.linear``, per shape and row count:

* device µs a call inside a CUDA graph (a graph of ``--calls`` calls, the median of ``--replays`` replays by CUDA
  events, ``fused_ops.graph_us``: the gaps between a graph's kernels included, as in a model's graph);
* kernels a call (the profiler, after every timed run);
* the error of the partials' fp32 sum and of ``F.linear`` against an fp64 reference (max abs, over the output's
  max abs);
* the extra bytes the consumer would read: ``S`` fp32 partials instead of one bf16 output.

The last line printed is one JSON object (``--out`` too).

Usage::

    python benchmarks/down_partials.py --rows 16,64,128,256 --splits 2,4,8 --out down_partials.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    import bcg  # noqa: F401
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_ops import graph_us  # this folder is the script's own

from bcg.ops.kernels.down_partials import down_partials, split_views

# model -> (intermediate size K, hidden size N) of its down projection
SHAPES = {"llama-dense": (2816, 1024), "llama-3.2-1b": (8192, 2048), "qwen3-0.6b": (3072, 1024)}


def kernels_per_call(fn: Callable[[], Any], calls: int = 10) -> tuple[float, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names) / calls, sorted({n[:70] for n in names})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64,128,256")
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("down_partials: needs CUDA (cuBLAS's kernels are what it measures)", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    measured: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    for model, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ w.double().T
            scale = ref.abs().max().item()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            # (name, splits, the call a graph captures, its result summed as the consumer would, in fp64)
            variants: list[tuple[str, int, Callable[[], Any], Callable[[], torch.Tensor]]] = [
                ("F.linear", 0, lambda x=x, w=w, out=out: torch.mm(x, w.T, out=out),
                 lambda x=x, w=w: F.linear(x, w).double())]
            for sp in [int(v) for v in args.splits.split(",") if k % int(v) == 0]:
                xs, ws = split_views(x, w, sp)
                p = torch.empty(sp, m, n, device="cuda", dtype=torch.float32)
                variants.append((f"partials S={sp}", sp,
                                 lambda xs=xs, ws=ws, p=p: torch.bmm(xs, ws, out_dtype=torch.float32, out=p),
                                 lambda x=x, w=w, sp=sp: down_partials(x, w, sp).sum(0).double()))
            for name, splits, fn, value in variants:
                row: dict[str, Any] = {"model": model, "rows": m, "variant": name,
                                       "extra_read_bytes": (splits * 4 - 2) * m * n if splits else 0}
                try:
                    row["error"] = (value() - ref).abs().max().item() / scale
                    row["device_us"] = graph_us(fn, args.calls, args.replays)
                except Exception as e:  # e.g. no bmm with out_dtype in this torch: say so, keep the others
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                measured.append((row, fn))
    # Profiled after every timed run (CUPTI, once loaded, slows later graphs).
    for row, fn in measured:
        if "failed" not in row:
            row["kernels_per_call"], row["kernels"] = kernels_per_call(fn)
    rows_out = [row for row, _ in measured]
    base = {(r["model"], r["rows"]): r.get("device_us") for r in rows_out if r["variant"] == "F.linear"}
    print("| model | rows | variant | device µs in a graph | vs F.linear | kernels a call | rel. error | extra read |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows_out:
        if "failed" in r:
            print(f"| {r['model']} | {r['rows']} | {r['variant']} | failed: {r['failed']} | | | | |")
            continue
        b = base.get((r["model"], r["rows"]))
        ratio = f"{r['device_us'] / b:.2f}x" if b else "-"
        print(f"| {r['model']} | {r['rows']} | {r['variant']} | {r['device_us']:.2f} | {ratio} | "
              f"{r['kernels_per_call']:.1f} | {r['error']:.1e} | {r['extra_read_bytes'] / 1e6:.2f} MB |")
    summary = {"kind": "down_partials", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "rows": rows_out}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
