"""Where the host time of a breakable prefill goes: is the GPU waiting for the CPU, and on what?

A breakable replay is fast only while the host launches each island faster than the GPU runs the segment before
it. This script measures, on one bucket of a model:

1. **ops**: host µs to launch each operation an attention island may use, on the island's real shapes (KV
   ``index_copy_``, ``varlen_attn``, the aten flash op, its in-place form, ``copy_``, ``zero_``) and one graph
   segment replay: the mean over ``--calls`` launches with no sync in between.
2. **replay**: host time to launch one whole replay of the bucket (no sync) against its device time; their ratio
   says whether the replay is host-bound.
3. **prefill**: ``Engine.prefill`` for 1 and ``--requests`` requests of ``--tokens`` total tokens: host time until
   it returns (it does not wait for the GPU), until its first graph replay is called (the GPU idles until then) and
   wall time, median of ``--runs``; each with the flash kernel called
   through the aten op and through ``varlen_attn`` (``BCG_FLASH=wrapper``); and a cProfile of the default path,
   the costliest host functions first, written to ``--out``.

Usage::

    python benchmarks/host_path.py --model llama-dense --tokens 64 --requests 16 --out host_path

The point is launch cost, so the numbers mean something only on a GPU; without CUDA the script runs on the CPU
(emulated graphs, SDPA islands) as a smoke test. The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import bcg  # noqa: F401
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bcg.bench.engines import make_prompts, one_batch, split_tokens
from bcg.bench.timing import FirstReplay, Marks, sync
from bcg.ops import flash
from bcg.runtime import Engine


def host_us(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    """Mean host µs per launch of ``fn`` over ``calls`` back-to-back launches (the device drains afterwards)."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync(device)
    return elapsed / calls * 1e6


def op_costs(eng: Engine, tokens: int, calls: int) -> dict[str, float]:
    """Launch cost of each island building block at the island's shapes (layer 0's cache, scratch tensors)."""
    cfg, dev, dt = eng.model.config, eng.device, eng.dtype
    q = torch.randn(tokens, cfg.num_heads, cfg.head_dim, device=dev, dtype=dt)
    k = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dt)
    out = torch.empty_like(q)
    slots = torch.arange(tokens, device=dev)
    cu = torch.tensor([0, tokens], device=dev, dtype=torch.int32)
    cache = eng.kv_pool.k[0]
    costs: dict[str, Callable[[], Any]] = {
        "index_copy_ (KV write)": lambda: cache.index_copy_(0, slots, k),
        "copy_ (island output)": lambda: out.copy_(q),
        "zero_ (padded rows)": lambda: out[tokens // 2:].zero_(),
        "slice q[:n]": lambda: q[: tokens - 1],
    }
    if flash.is_varlen_usable(q):
        costs["varlen_attn (custom op)"] = lambda: flash._wrapper(q, k, k, cu, cu, tokens, tokens, True)
        if flash._FLASH is not None:
            costs["aten flash"] = lambda: flash._FLASH(q, k, k, cu, cu, tokens, tokens, 0.0, True, False)
        if flash._FLASH_INPLACE is not None:
            costs["aten flash in place"] = lambda: flash._FLASH_INPLACE(out, q, k, k, cu, cu, tokens, tokens, 0.0,
                                                                        True, False)
    if dev.type == "cuda":
        graph, x = torch.cuda.CUDAGraph(), torch.zeros(16, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            x.add_(1)
        costs["graph segment replay (1 kernel)"] = graph.replay
    return {name: host_us(fn, calls, dev) for name, fn in costs.items()}


def replay_split(eng: Engine, tokens: int, runs: int) -> dict[str, float]:
    """Host ms to launch one replay of the bucket (no sync) and its device ms (CUDA events)."""
    prompt = make_prompts([tokens], eng.model.config.vocab_size, 0)[0]
    batch, slots = one_batch(eng, prompt)
    host, device = [], []
    try:
        with torch.inference_mode(), eng.runner.replay_context(batch) as (_, handle):
            for i in range(runs + 3):
                marks = Marks(eng.device)
                marks.mark()
                t0 = time.perf_counter()
                handle.replay()
                t1 = time.perf_counter()
                marks.mark()
                if i >= 3:
                    host.append((t1 - t0) * 1e3)
                    device.append(marks.deltas_ms()[0])
                else:
                    marks.deltas_ms()
    finally:
        eng.kv_pool.free(slots)
    h, d = statistics.median(host), statistics.median(device)
    return {"host_launch_ms": h, "device_ms": d, "host_over_device": h / d,
            "segments": handle.num_segments, "breaks": handle.num_breaks}


def prefill_times(eng: Engine, prompts: list[torch.Tensor], runs: int) -> dict[str, float]:
    """Median host ms until ``prefill`` returns, until its first graph replay is called (what the GPU waits for
    first: validation, planning, staging; a whole-step graph's or a breakable graph's first segment), and median
    wall ms until the device is done."""
    host, wall, launch = [], [], []
    marks: list[float] = []
    with FirstReplay(lambda: marks.append(time.perf_counter())) as first:
        for i in range(runs + 3):
            sync(eng.device)
            first.arm()
            t0 = time.perf_counter()
            eng.prefill(prompts)
            t1 = time.perf_counter()
            sync(eng.device)
            t2 = time.perf_counter()
            if i >= 3:
                host.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
                if first.fired:
                    launch.append((marks[-1] - t0) * 1e3)
    return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall),
            "first_replay_ms": statistics.median(launch) if launch else None}


# The steps of a prefill's host path, in the order they run: (label, module, attribute path of the function).
STAGES = [
    ("validate prompts", "bcg.runtime.engine", "validate_prompts"),
    ("reserve KV slots", "bcg.runtime.serving.gate", "ActivityGate.reserve"),
    ("plan the forward", "bcg.runtime.serving.batcher", "Batcher.plan"),
    ("choose the bucket", "bcg.runtime.runner.runner", "Runner.choose"),
    ("load the batch", "bcg.runtime.runner.inputs", "StaticInputs.load"),
    ("  copy it to the device", "bcg.ops.staging", "Staged.upload"),
    ("breakable graph replay call", "bcg.graph", "BreakableCUDAGraph.replay"),
    ("whole-step graph replay call", "torch.cuda", "CUDAGraph.replay"),  # CUDA only
    ("logits and greedy tokens", "bcg.runtime.prefill", "finished_logits"),
    ("after the launch", "bcg.runtime.serving.batcher", "Batcher.launched"),
]


def stage_times(eng: Engine, prompts: list[torch.Tensor], runs: int) -> list[dict[str, Any]]:
    """Median start (µs after ``prefill`` was called) and duration of each of :data:`STAGES` over ``runs`` prefills
    (a step that did not run in a prefill is left out of its medians); the whole call as ``prefill``."""
    marks: list[tuple[str, int, int]] = []
    patched: list[tuple[Any, str, Any]] = []
    labels = ["prefill"]
    for label, module, path in STAGES:
        if module == "torch.cuda" and not torch.cuda.is_available():
            continue
        owner: Any = importlib.import_module(module)
        *parents, name = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def timed(*args: Any, _fn: Any = fn, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                marks.append((_label, t0, time.perf_counter_ns()))

        patched.append((owner, name, fn))
        setattr(owner, name, timed)
        labels.append(label)
    starts: dict[str, list[float]] = {label: [] for label in labels}
    durations: dict[str, list[float]] = {label: [] for label in labels}
    try:
        for i in range(runs + 3):
            sync(eng.device)
            marks.clear()
            t0 = time.perf_counter_ns()
            eng.prefill(prompts)
            marks.append(("prefill", t0, time.perf_counter_ns()))
            seen: set[str] = set()
            for label, start, end in marks if i >= 3 else []:
                if label not in seen:  # a step run twice in one prefill: its first run
                    seen.add(label)
                    starts[label].append((start - t0) / 1e3)
                    durations[label].append((end - start) / 1e3)
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)
    return [{"stage": label, "start_us": statistics.median(starts[label]), "us": statistics.median(durations[label])}
            for label in labels if starts[label]]


def profile_text(eng: Engine, prompts: list[torch.Tensor], calls: int = 500, top: int = 30) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        eng.prefill(prompts)
    prof.disable()
    sync(eng.device)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return f"{calls} prefills of {len(prompts)} request(s)\n{buf.getvalue()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-dense")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("host_path"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type != "cuda":
        print("host_path: no CUDA, running on the CPU as a smoke test; these timings say nothing about launch cost")
    eng = Engine(args.model, backend="breakable", device=args.device, buckets=[args.tokens], progress=False)
    name = torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu"
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "torch": torch.__version__, "device": name,
                              "aten_flash": eng.device.type == "cuda" and flash.uses_aten_flash(eng.device)}
    with torch.inference_mode():  # islands run under inference mode; the KV pool may only be written there
        result["ops_us"] = op_costs(eng, args.tokens, args.calls)
    result["replay"] = replay_split(eng, args.tokens, args.runs)
    vocab = eng.model.config.vocab_size
    result["prefill"] = {}
    for num_requests in sorted({1, args.requests}):
        prompts = make_prompts(split_tokens(args.tokens, num_requests), vocab, num_requests)
        row = {"aten": prefill_times(eng, prompts, args.runs)}
        flash.FORCE_WRAPPER = True  # what BCG_FLASH=wrapper sets at import
        try:
            row["varlen_attn"] = prefill_times(eng, prompts, args.runs)
        finally:
            flash.FORCE_WRAPPER = False
        result["prefill"][num_requests] = row
        (args.out / f"profile_{num_requests}req.txt").write_text(profile_text(eng, prompts))
    result["stages"] = stage_times(eng, make_prompts([args.tokens], vocab, 1), args.runs)
    print(f"{args.model}, bucket {args.tokens}, {name}, torch {torch.__version__}")
    print("\nhost µs per launch")
    for name, us in result["ops_us"].items():
        print(f"  {name:<34} {us:8.1f}")
    r = result["replay"]
    print(f"\nreplay: host launch {r['host_launch_ms']:.2f} ms, device {r['device_ms']:.2f} ms "
          f"(host/device {r['host_over_device']:.2f}; {r['segments']} segments, {r['breaks']} breaks)")
    print("\nprefill (median ms)      host    wall  first replay called")
    for n, row in result["prefill"].items():
        for path, t in row.items():
            launch = "-" if t["first_replay_ms"] is None else f"{t['first_replay_ms']:.3f}"
            print(f"  {n:>2} request(s), {path:<12} {t['host_ms']:6.2f}  {t['wall_ms']:6.2f}  {launch:>8}")
    print("\none request's host path (median µs)   start    takes")
    for st in result["stages"]:
        print(f"  {st['stage']:<34} {st['start_us']:7.1f}  {st['us']:7.1f}")
    print("\n" + (args.out / "profile_1req.txt").read_text())
    (args.out / "host_path.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
