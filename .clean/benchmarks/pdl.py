"""Does programmatic dependent launch (PDL) survive capture into a CUDA graph on this torch and Triton, and what does it
save between bcg's kind of kernels?

Inside a graph, kernels run about 1 µs apart (issue 29: a 64-token llama-dense prefill is 291-319 kernels): the next
kernel is launched only once the previous one has completed and its writes are flushed. With PDL (Hopper and later)
a kernel launched with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may start while the one before it
finishes, and waits at ``griddepcontrol.wait`` (Triton: ``tl.extra.cuda.gdc_wait()``) until that one's writes are
visible; the one before may release it early with ``griddepcontrol.launch_dependents``. Triton launches a kernel that
way when called with ``launch_pdl=True``. Whether a stream capture keeps the attribute as a programmatic edge of the
graph decides whether it helps a replay at all.

Three chains, each of ``--chain`` launches, timed with CUDA events (device µs per kernel) on the stream and as one
captured graph, PDL off and on:

* ``triton``: a Triton elementwise kernel (``y = x + 1``) feeding itself: the best case (every kernel waits and
  releases);
* ``gemm+triton``: a bf16 cuBLAS GEMM of a 64-token layer's shape, then the Triton kernel on its output: bcg's
  layers (a GEMM, then a norm, RoPE or activation kernel); only the Triton kernel is launched with PDL;
* ``gdc only``: the Triton chain with the wait and release instructions but launched without PDL (their own cost).

Each mode's result is checked (the chain's final value). The last line printed is one JSON object (``--out`` too).

Usage::

    python benchmarks/pdl.py --chain 200 --out pdl.json

CUDA only: on a machine without a GPU (or without Triton) it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if GDC:
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
        x = tl.load(x_ptr + offs, mask=mask)
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start; it waits for this one's stores
        tl.store(y_ptr + offs, x + 1, mask=mask)
except ImportError:  # the CPU tier without the test extra: the script refuses below
    triton = None

BLOCK = 1024


def _launch(x: torch.Tensor, y: torch.Tensor, gdc: bool, pdl: bool) -> None:
    n = x.numel()
    kwargs = {"launch_pdl": True} if pdl else {}
    _add_one_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, BLOCK=BLOCK, GDC=gdc, num_warps=4, **kwargs)


def _chain(kind: str, bufs: dict[str, torch.Tensor], steps: int, gdc: bool, pdl: bool) -> None:
    a, b = bufs["a"], bufs["b"]
    for i in range(steps):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        if kind == "gemm+triton":
            torch.mm(bufs["x"], bufs["w"], out=bufs["h"])  # the GEMM the Triton kernel follows in a layer
        _launch(src, dst, gdc, pdl)


def _device_us(fn: Any, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def measure(kind: str, mode: str, numel: int, steps: int, reps: int) -> dict[str, Any]:
    gdc, pdl = {"off": (False, False), "on": (True, True), "gdc only": (True, False)}[mode]
    dev = "cuda"
    bufs = {"a": torch.zeros(numel, device=dev), "b": torch.zeros(numel, device=dev),
            "x": torch.randn(64, 1024, device=dev, dtype=torch.bfloat16),
            "w": torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16),
            "h": torch.empty(64, 1024, device=dev, dtype=torch.bfloat16)}
    row: dict[str, Any] = {"chain": kind, "mode": mode, "numel": numel, "steps": steps}
    try:
        stream_us = _device_us(lambda: _chain(kind, bufs, steps, gdc, pdl), reps)
        bufs["a"].zero_()
        bufs["b"].zero_()
        _chain(kind, bufs, steps, gdc, pdl)
        torch.cuda.synchronize()
        last = bufs["a"] if steps % 2 == 0 else bufs["b"]
        row["stream_correct"] = bool((last == steps).all())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up off the capture: Triton compiles and caches the launcher here
            _chain(kind, bufs, 2, gdc, pdl)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _chain(kind, bufs, steps, gdc, pdl)
        graph_us = _device_us(graph.replay, reps)
        bufs["a"].zero_()
        bufs["b"].zero_()
        graph.replay()
        torch.cuda.synchronize()
        row["graph_correct"] = bool((last == steps).all())
        row.update(stream_us_per_step=stream_us / steps, graph_us_per_step=graph_us / steps)
    except Exception as e:  # an unsupported launch option or capture: recorded, the other rows go on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chain", type=int, default=200, help="launches per chain (default: %(default)s)")
    ap.add_argument("--numel", default="4096,1048576", help="elements the Triton kernel adds one to")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("pdl.py measures programmatic dependent launch on a GPU with Triton; this machine has "
              f"{'no CUDA device' if not torch.cuda.is_available() else 'no triton'}", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    rows = [measure(kind, mode, int(n), args.chain, args.reps)
            for kind in ("triton", "gemm+triton") for n in args.numel.split(",") for mode in ("off", "on", "gdc only")]
    print(f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.chain} launches a chain\n")
    print("| chain | elements | mode | stream µs/step | graph µs/step | graph vs off | correct |")
    print("|---|---:|---|---:|---:|---:|---|")
    base = {(r["chain"], r["numel"]): r.get("graph_us_per_step") for r in rows if r["mode"] == "off"}
    for r in rows:
        if "error" in r:
            print(f"| {r['chain']} | {r['numel']} | {r['mode']} | - | - | - | {r['error']} |")
            continue
        off = base.get((r["chain"], r["numel"]))
        ratio = f"{r['graph_us_per_step'] / off:.2f}" if off else "-"
        print(f"| {r['chain']} | {r['numel']} | {r['mode']} | {r['stream_us_per_step']:.2f} | "
              f"{r['graph_us_per_step']:.2f} | {ratio} | {r['stream_correct'] and r['graph_correct']} |")
    out = {"kind": "pdl", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "rows": rows}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
