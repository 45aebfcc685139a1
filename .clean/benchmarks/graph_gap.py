"""What a kernel costs inside a replayed CUDA graph beyond its own profiled device time, for chains of kernels like a
short prompt's layers rather than one kernel repeated.

`bcg analyze` predicts a graph's device time as its kernels' eager device times plus a per-kernel gap. Its first
probes repeated one tiny (or medium) add and read -0.03 to +0.09 µs on the H200, while the H200's analyze runs,
replayed through the model, fit a gap near 0.5 µs a kernel (benchmarks/results/h200-2026-12-02-r5/REPORT.md, issue
30): the same kernel launched again may be cheaper to start than a different one. This measures both kinds of chain
the same way: the chain's kernels profiled eagerly (the sum of their device times, as the model reads an eager
profile), then the same chain captured into one graph and replayed (CUDA events); the gap is the difference over the
kernels. On the H200 it read about 0.33 µs a kernel for every chain
(benchmarks/results/h200-2026-12-02-r6/REPORT.md).

Chains (bf16, the llama-dense shapes at 64 tokens unless named otherwise):

* ``add x1``: one tiny in-place add repeated (the machine probe's kind);
* ``layer-like``: a GEMM (64 x 1024 x 1024), a residual add, an RMSNorm in torch ops (pow, mean, rsqrt, two muls) and
  a SiLU-and-multiply in torch ops, each writing a fixed buffer: different kernels in turn (the mixed chain of
  ``bcg.bench.machine_probes``, which `bcg analyze` now measures as the machine's graph gap);
* ``gemms``: the four GEMMs of a llama-dense layer at 64 tokens in turn.

The last line printed is one JSON object (``--out`` too).

Usage::

    python benchmarks/graph_gap.py --repeat 40 --out graph_gap.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def chains(tokens: int, dev: str = "cuda") -> dict[str, Callable[[], None]]:
    """The chains (see the module doc), each a call that writes only buffers it made (capturable as it is); the
    layer-like one is the mixed chain `bcg analyze` measures (at ``tokens``)."""
    from bcg.bench.machine_probes import mixed_chain

    bf16 = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * shape[-1] ** -0.5).to(bf16)

    tiny = torch.zeros(1, device=dev)
    x, act = randn(tokens, 1024), randn(tokens, 2816)
    ws = {"qkv": randn(1024, 1536), "o": randn(1024, 1024), "gate_up": randn(1024, 5632), "down": randn(2816, 1024)}
    outs = {k: torch.empty(tokens, v.shape[1], device=dev, dtype=bf16) for k, v in ws.items()}
    ins = {"qkv": x, "o": x, "gate_up": x, "down": act}

    def add_x1() -> None:
        tiny.add_(1.0)

    def gemms() -> None:
        for k, wt in ws.items():
            torch.mm(ins[k], wt, out=outs[k])

    return {"add x1": add_x1, "layer-like": mixed_chain(torch.device(dev), (tokens, 1024, 2816)), "gemms": gemms}


def _profiled(fn: Callable[[], None], repeat: int) -> tuple[int, float]:
    """(kernels, summed device µs) of ``repeat`` calls of ``fn`` run eagerly under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    spans = [e.time_range.end - e.time_range.start for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return len(spans), sum(spans)


def _replayed_us(fn: Callable[[], None], repeat: int, reps: int) -> float:
    """Median device µs of one replay of a graph holding ``repeat`` calls of ``fn`` (CUDA events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure(tokens: int, repeat: int, reps: int) -> list[dict[str, Any]]:
    rows = []
    for name, fn in chains(tokens).items():
        row: dict[str, Any] = {"chain": name, "tokens": tokens, "repeat": repeat}
        try:
            kernels, eager_us = _profiled(fn, repeat)
            graph_us = _replayed_us(fn, repeat, reps)
            row.update(kernels=kernels, eager_kernel_us=eager_us, graph_us=graph_us,
                       gap_us_per_kernel=(graph_us - eager_us) / max(kernels, 1))
        except Exception as e:  # recorded, the other chains go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,256", help="token counts of the chains' activations")
    ap.add_argument("--repeat", type=int, default=40, help="calls of a chain in one graph (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=20, help="replays timed (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_gap.py measures CUDA graph replays; this machine has no CUDA device", file=sys.stderr)
        return 2
    rows = [r for n in args.tokens.split(",") for r in measure(int(n), args.repeat, args.reps)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| chain | tokens | kernels | eager kernel µs (sum) | graph replay µs | gap µs a kernel |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['chain']} | {r['tokens']} | - | - | - | {r['error']} |")
        else:
            print(f"| {r['chain']} | {r['tokens']} | {r['kernels']} | {r['eager_kernel_us']:.1f} | {r['graph_us']:.1f} "
                  f"| {r['gap_us_per_kernel']:+.2f} |")
    out = {"kind": "graph_gap", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
