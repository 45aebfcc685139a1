"""``bcg analyze``: should this model on this machine use breakable graphs, and with which capture ceiling?

Measures the four quantities the seed's Amdahl argument rests on, then judges:

1. launch-gap share of an eager forward (device busy time from the profiler vs wall time);
2. ``p``, the share of a breakable replay spent in eager islands, per island name (each step of the handle is
   timed inside ``runner.replay_context``), with ``S_max = 1 / p``; and whether the replay is host-bound (the host
   time to launch it against its device time);
3. bucket coverage of a prompt-length distribution, decided by the runner's own ``choose``;
4. resident graph memory against free device memory.

The predicted speedup comes from the measured parts (outside-graph work + islands + replayed segments) and is
checked against the measured eager-vs-breakable forward times at a representative length.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from bcg.bench import amdahl
from bcg.bench.config import AnalyzeConfig, BenchError
from bcg.bench.engines import BuildRecord, EngineSpec, engine_for, make_prompts, one_batch
from bcg.bench.timing import Marks, gpu_kernel_ms, sync, time_fn
from bcg.bench.verdict import verdict

__all__ = ["run_analyze", "sample_lengths"]


def sample_lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    """``n`` seeded log-uniform prompt lengths in ``[low, high]`` (short prompts are common, long ones rare).

    Example::

        >>> xs = sample_lengths(100, 16, 2048, seed=0)
        >>> len(xs), min(xs) >= 16, max(xs) <= 2048
        (100, True, True)
    """
    low, high = max(1, min(low, high)), max(1, high)
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    xs = torch.exp(math.log(low) + u * (math.log(high) - math.log(low)))
    return [min(max(int(round(x)), low), high) for x in xs.tolist()]


def _forward_time(eng: Any, prompt: torch.Tensor, cfg: AnalyzeConfig, kernel: bool) -> tuple[float, float | None]:
    """Median time of ``runner.forward`` on a one-request batch (the engine's per-forward path), and its
    device kernel time."""
    batch, slots = one_batch(eng, prompt)
    try:
        with torch.inference_mode():
            def call() -> Any:
                return eng.runner.forward(batch)

            t = time_fn(call, cfg.device, runs=cfg.runs, warmup=cfg.warmup)
            k = gpu_kernel_ms(call, cfg.device, warmup=0) if kernel else None
    finally:
        eng.kv_pool.free(slots)
    return t.median_ms, k


def _replay_breakdown(eng: Any, prompt: torch.Tensor, cfg: AnalyzeConfig) -> dict[str, Any]:
    """Times each step of one bucket's breakable replay; islands are grouped by name."""
    from bcg.graph import EagerStep

    runner = eng.runner
    bucket, reason = runner.choose(prompt.numel())
    if bucket is None:
        return {"bucket": None, "note": f"a {prompt.numel()}-token batch does not replay a graph ({reason})"}
    batch, slots = one_batch(eng, prompt)
    try:
        with torch.inference_mode():
            outside = time_fn(lambda: _enter_exit(runner, batch), cfg.device, runs=cfg.runs, warmup=cfg.warmup)
            with runner.replay_context(batch) as (bucket, handle):
                steps = list(handle.steps)
                whole = time_fn(handle.replay, cfg.device, runs=cfg.runs, warmup=cfg.warmup)
                host_ms = _host_launch_ms(handle.replay, cfg)
                per_run: list[list[float]] = []
                for i in range(cfg.warmup + cfg.runs):
                    marks = Marks(cfg.device, capacity=len(steps) + 1)
                    marks.mark()
                    for step in steps:
                        step() if isinstance(step, EagerStep) else step.replay()
                        marks.mark()
                    if i >= cfg.warmup:
                        per_run.append(marks.deltas_ms())
    finally:
        eng.kv_pool.free(slots)
    is_island = [isinstance(s, EagerStep) for s in steps]
    seg = statistics.median(sum(d for d, isl in zip(run, is_island) if not isl) for run in per_run)
    names: dict[str, list[int]] = defaultdict(list)
    for idx, step in enumerate(steps):
        if is_island[idx]:
            names[step.name].append(idx)
    islands = [{"name": name, "count": len(idxs),
                "ms": statistics.median(sum(run[i] for i in idxs) for run in per_run)} for name, idxs in names.items()]
    isl = sum(i["ms"] for i in islands)
    for i in islands:
        i["share"] = i["ms"] / (seg + isl) if seg + isl > 0 else None
    islands.sort(key=lambda i: -i["ms"])
    return {
        "bucket": bucket, "num_segments": len(steps) - sum(is_island), "num_breaks": sum(is_island),
        "num_islands": len(islands), "segments_ms": seg, "islands_ms": isl, "outside_ms": outside.median_ms,
        "replay_ms": whole.median_ms, "replay_host_ms": host_ms, "host_over_device": host_ms / whole.median_ms,
        "p": amdahl.island_fraction(isl, seg + isl) if seg + isl > 0 else None,
        "islands": islands,
    }


def _host_launch_ms(fn: Any, cfg: AnalyzeConfig) -> float:
    """Median host time for ``fn`` to return, from an idle device and without waiting for it: below the device
    time the islands' host work hides behind the GPU; near it, the replay is host-bound."""
    samples = []
    for i in range(cfg.warmup + cfg.runs):
        sync(cfg.device)
        t0 = time.perf_counter()
        fn()
        if i >= cfg.warmup:
            samples.append((time.perf_counter() - t0) * 1e3)
    sync(cfg.device)
    return statistics.median(samples)


def _enter_exit(runner: Any, batch: Any) -> None:
    # Embedding + loading the static buffers + setting the context: the eager work around a replay.
    with runner.replay_context(batch):
        pass


def _coverage(eng: Any, lengths: list[int], chunk: int) -> dict[str, Any]:
    from bcg.runtime.runner.buckets import default_ladder

    runner = eng.runner
    buckets = list(runner.table.sizes)
    cov = amdahl.bucket_coverage(lengths, runner.choose, buckets, chunk)
    out = dict(vars(cov))
    out["forward_graph"] = [runner.choose(n)[0] is not None for n in cov.forward_sizes]
    out["num_buckets"] = len(buckets)
    out["recommended_ceiling"] = amdahl.smallest_covering_ceiling(cov.forward_sizes, default_ladder(chunk), chunk)
    return out


def _memory(eng: Any, record: BuildRecord) -> dict[str, Any]:
    mem: dict[str, Any] = {"graph_memory_bytes": record.graph_memory_bytes, "num_buckets": record.num_captured,
                           "capture_ms": record.capture_ms, "free_bytes": None, "total_bytes": None,
                           "graph_share_of_free": None, "note": None}
    if eng.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(eng.device)
        mem.update(free_bytes=free, total_bytes=total,
                   graph_share_of_free=(record.graph_memory_bytes or 0) / free if free else None)
    else:
        mem["note"] = "no device memory on a CPU; graph memory is only measured on CUDA"
    return mem


def run_analyze(cfg: AnalyzeConfig, environment: dict[str, Any]) -> dict[str, Any]:
    """Runs every measurement of ``bcg analyze`` for a resolved ``cfg``; returns the analysis as plain data.

    Example::

        a = run_analyze(AnalyzeConfig(model="tiny-dense", device="cpu").resolved(), environment={})
        a["amdahl"]["p"], a["verdict"]["sentence"]
    """
    chunk, length, spec = cfg.chunked_prefill_size, cfg.length, cfg.engine_spec()
    lengths = cfg.lengths or sample_lengths(cfg.num_prompts, 16, chunk, cfg.seed)
    a: dict[str, Any] = {"schema": "bcg.analyze/1", "kind": "analyze", "environment": environment}
    timing: dict[str, Any] = {"length": length}
    record = BuildRecord("breakable")
    # Breakable first, eager (with the profiler) last: CUPTI then never runs before a timed forward.
    with engine_for(spec, "breakable", record) as eng:
        if eng is None:
            raise BenchError(f"the breakable engine of {cfg.model!r} could not be built ({record.error})")
        a["model"] = _describe_model(eng, cfg.model)
        prompt = make_prompts([length], eng.model.config.vocab_size, cfg.seed)[0]
        timing["breakable_forward_ms"], _ = _forward_time(eng, prompt, cfg, kernel=False)
        replay = _replay_breakdown(eng, prompt, cfg)
        a["coverage"] = _coverage(eng, lengths, chunk)
        a["memory"] = _memory(eng, record)
    del eng
    eager_record = BuildRecord("eager")
    with engine_for(spec.replace(max_tokens=chunk), "eager", eager_record) as eng:
        if eng is None:
            raise BenchError(f"the eager engine of {cfg.model!r} could not be built ({eager_record.error})")
        timing["eager_forward_ms"], timing["eager_kernel_ms"] = _forward_time(eng, prompt, cfg, kernel=True)
    del eng
    timing["breakable_kernel_ms"] = _breakable_kernel_ms(spec, prompt, cfg)
    a["build"] = vars(record)
    timing["launch_gap_share"] = amdahl.launch_gap_share(timing["eager_kernel_ms"], timing["eager_forward_ms"])
    timing["launch_bound"] = amdahl.launch_bound(timing["eager_forward_ms"], timing["eager_kernel_ms"])
    timing["measured_speedup"] = timing["eager_forward_ms"] / timing["breakable_forward_ms"]
    a["timing"], a["replay"] = timing, replay
    a["amdahl"] = _amdahl(timing, replay)
    a["verdict"] = verdict(a)
    return a


def _breakable_kernel_ms(spec: EngineSpec, prompt: torch.Tensor, cfg: AnalyzeConfig) -> float | None:
    """The device time of one breakable forward, profiled in a fresh engine after every timed forward (the profiler,
    once loaded, slows later host work); ``None`` on a CPU or when it no longer replays a graph."""
    if cfg.emulated:
        return None
    with engine_for(spec.replace(progress=False), "breakable") as eng:
        if eng is None or eng.runner.choose(prompt.numel())[0] is None:
            return None
        return _forward_time(eng, prompt, replace(cfg, runs=1, warmup=0), kernel=True)[1]


def _amdahl(timing: dict[str, Any], replay: dict[str, Any]) -> dict[str, Any]:
    if replay.get("bucket") is None:
        return {"p": None, "s_max": None, "note": replay.get("note")}
    eager = timing["eager_forward_ms"]
    # Each step's time already includes its own launch, so no extra per-break overhead is added.
    pred = amdahl.predict_breakable(eager, replay["islands_ms"], replay["segments_ms"], replay["num_breaks"],
                                    per_break_ms=0.0, outside_ms=replay["outside_ms"])
    stays_eager = replay["islands_ms"] + replay["outside_ms"]
    return {
        "p": replay["p"], "s_max": amdahl.s_max(replay["p"]),
        # The Amdahl ceiling over eager: everything but the islands and the outside work made free.
        "p_of_eager": amdahl.island_fraction(stays_eager, eager),
        "s_max_over_eager": eager / stays_eager if stays_eager > 0 else math.inf,
        "per_break_ms": 0.0, "predicted_breakable_ms": pred.breakable_ms, "predicted_speedup": pred.speedup,
        "measured_breakable_ms": timing["breakable_forward_ms"], "measured_speedup": timing["measured_speedup"],
        "prediction_error": amdahl.prediction_error(pred.breakable_ms, timing["breakable_forward_ms"]),
    }


def _describe_model(eng: Any, name: str) -> dict[str, Any]:
    mc = eng.model.config
    return {"name": name, "arch": mc.arch, "num_layers": mc.num_layers, "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size, "num_params": sum(p.numel() for p in eng.model.parameters()),
            "dtype": str(eng.dtype).replace("torch.", ""), "device": str(eng.device)}
