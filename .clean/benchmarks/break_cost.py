"""What a graph break costs: capture time, replay time and microseconds per break.

A chain of ``--kernels`` tiny in-place adds on a small tensor is captured as one BreakableCUDAGraph, split by B
breaks (B from ``--breaks``). Each break calls an eager function that launches one small in-place kernel and
returns None (the zero-copy style). For each B the script reports capture time (total and per segment), the median
replay time over ``--replays`` replays (CUDA events, after a warm-up), the time of the same work run eagerly, and
``us/break = (replay(B) - replay(0)) / B``. The same is measured for an eager function that returns a tensor (the
boundary-buffer copy path). The last line printed is one JSON object with every number.

Usage::

    python benchmarks/break_cost.py --breaks 0,1,8,32,128 --kernels 256 --replays 200 --out break_cost.json

Without CUDA it runs the CPU emulation as a smoke test; those timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import bcg
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import bcg

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
WARMUP = 10


@bcg.eager_on_graph
def eager_inplace(side: torch.Tensor) -> None:
    """The zero-copy break: one small kernel in place, nothing returned."""
    side.add_(1.0)


@bcg.eager_on_graph
def eager_returning(side: torch.Tensor) -> torch.Tensor:
    """The boundary-copy break: one small kernel whose fresh result replay copies into the boundary buffer."""
    return side + 1.0


def break_positions(kernels: int, breaks: int) -> list[int]:
    """How many breaks follow each kernel: B breaks spread evenly over the chain (several per slot if B > K)."""
    after = [0] * kernels
    for j in range(breaks):
        after[min(kernels - 1, (j + 1) * kernels // (breaks + 1))] += 1
    return after


def make_step(kernels: int, breaks: int, x: torch.Tensor, side: torch.Tensor, eager_fn: Callable) -> Callable:
    after = break_positions(kernels, breaks)

    def step() -> None:
        for i in range(kernels):
            x.add_(1e-3)
            for _ in range(after[i]):
                eager_fn(side)

    return step


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def median_us(fn: Callable[[], None], n: int) -> float:
    """Median wall time of ``fn`` in microseconds: CUDA events around each call on a GPU, perf_counter on CPU."""
    for _ in range(min(WARMUP, n)):
        fn()
    sync()
    samples = []
    if CUDA:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(n):
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def measure(kernels: int, breaks: int, replays: int, eager_fn: Callable) -> dict:
    x = torch.zeros(64, device=DEVICE)
    side = torch.zeros(64, device=DEVICE)
    step = make_step(kernels, breaks, x, side, eager_fn)
    step()  # warm up the kernels outside the capture
    sync()

    g = bcg.BreakableCUDAGraph()
    t0 = time.perf_counter()
    with bcg.breakable_graph(g):
        step()
    sync()
    capture_ms = (time.perf_counter() - t0) * 1e3

    # correctness: a replay does exactly the eager work
    x.zero_()
    side.zero_()
    g.replay()
    sync()
    replayed = (x.clone(), side.clone())
    x.zero_()
    side.zero_()
    step()
    torch.testing.assert_close(replayed, (x, side))

    return {
        "breaks": breaks,
        "segments": g.num_segments,
        "capture_ms": capture_ms,
        "capture_ms_per_segment": capture_ms / max(g.num_segments, 1),
        "replay_us": median_us(g.replay, replays),
        "eager_us": median_us(step, replays),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--breaks", default="0,1,8,32,128", help="comma-separated break counts (0 is always added)")
    parser.add_argument("--kernels", type=int, default=256, help="tiny in-place kernels in the chain")
    parser.add_argument("--replays", type=int, default=200, help="replays per measurement (median)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    break_counts = sorted({0, *(int(b) for b in args.breaks.split(",") if b.strip())})
    if args.kernels < 1 or args.replays < 1 or break_counts[0] < 0:
        parser.error("--kernels and --replays must be positive and --breaks non-negative")

    device_name = torch.cuda.get_device_name() if CUDA else "cpu (emulation)"
    if not CUDA:
        print("=" * 78)
        print("NOTE: no CUDA here; running the CPU emulation as a smoke test. TIMINGS ARE MEANINGLESS.")
        print("=" * 78)
    print(f"bcg break cost | torch {torch.__version__} | {device_name} | {args.kernels} kernels | "
          f"median of {args.replays} replays")

    measure(args.kernels, 1, 2, eager_inplace)  # warm up: the first capture pays one-time setup
    rows = [measure(args.kernels, b, args.replays, eager_inplace) for b in break_counts]
    returning = {b: measure(args.kernels, b, args.replays, eager_returning) for b in break_counts}
    base, base_ret = rows[0]["replay_us"], returning[0]["replay_us"]
    for row in rows:
        b = row["breaks"]
        row["us_per_break"] = (row["replay_us"] - base) / b if b else None
        row["replay_us_returning"] = returning[b]["replay_us"]
        row["us_per_break_returning"] = (returning[b]["replay_us"] - base_ret) / b if b else None

    def fmt(v: float | None, spec: str = "9.2f") -> str:
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])

    header = (f"{'breaks':>6} {'segs':>5} {'capture ms':>10} {'ms/seg':>7} {'replay us':>10} {'eager us':>10} "
              f"{'us/break':>9} {'ret us/break':>12}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['breaks']:>6} {r['segments']:>5} {r['capture_ms']:>10.2f} {r['capture_ms_per_segment']:>7.3f} "
              f"{r['replay_us']:>10.1f} {r['eager_us']:>10.1f} {fmt(r['us_per_break'])} "
              f"{fmt(r['us_per_break_returning'], '12.2f')}")
    print("us/break: (replay(B) - replay(0)) / B, the eager function's own kernel included; "
          "ret: the eager function returns a tensor (boundary copy)")

    result = {
        "benchmark": "break_cost",
        "torch": torch.__version__,
        "device": device_name,
        "emulated": not CUDA,
        "kernels": args.kernels,
        "replays": args.replays,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
