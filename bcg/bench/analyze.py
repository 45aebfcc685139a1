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
from typing import Any

import torch

from bcg.bench import amdahl
from bcg.bench.config import AnalyzeConfig
from bcg.bench.engines import BuildRecord, engine_for, make_prompts, one_batch
from bcg.bench.report import fmt, fmt_bytes, table
from bcg.bench.timing import Marks, gpu_kernel_ms, sync, time_fn

__all__ = ["PAYS_THRESHOLD", "format_analysis", "run_analyze", "sample_lengths", "verdict"]

# Below a 5% gain the extra capture time and resident memory are not worth it.
PAYS_THRESHOLD = 1.05
# Resident graphs above this share of free memory eat into the KV cache noticeably.
MEMORY_SHARE_LIMIT = 0.10


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
    from bcg.runtime.buckets import default_ladder

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


def verdict(a: dict[str, Any]) -> dict[str, Any]:
    """Judges from an analysis dict: does breakable pay, and which capture ceiling to use; one sentence.

    Example::

        verdict(analysis)["sentence"]   # "Breakable graphs pay here: 1.84x measured ..."
    """
    t, am, cov, mem = a["timing"], a["amdahl"], a["coverage"], a["memory"]
    speedup = t.get("measured_speedup")
    pays = speedup is not None and speedup >= PAYS_THRESHOLD
    chunk, ceiling = cov["chunked_prefill_size"], cov["recommended_ceiling"]
    share = mem.get("graph_share_of_free")
    too_big = share is not None and share > MEMORY_SHARE_LIMIT
    where = f"at {t['length']} tokens"
    # S_max = 1/p bounds what capturing the islands too could still win over this replay; the bound over eager
    # (islands and host work kept, everything else free) is the other number a reader compares with.
    bound = (f"islands are p={fmt(am.get('p'))} of a replay, so at most S_max={fmt(am.get('s_max'))}x more from "
             f"capturing them and {fmt(am.get('s_max_over_eager'))}x over eager" if am.get("p") is not None
             else "p unknown")
    if t.get("launch_bound") is not None:
        # What no launch path can beat without fusing kernels: how far a speedup target is reachable at all.
        bound += f"; no graph beats eager by more than {t['launch_bound']:.2f}x here without fusing kernels"
    if pays and not too_big:
        head = (f"Breakable graphs pay here: {speedup:.2f}x measured (predicted {fmt(am.get('predicted_speedup'))}x, "
                f"{bound}) {where}")
    elif pays:
        head = (f"Breakable graphs are faster here ({speedup:.2f}x {where}) but their resident memory is "
                f"{share:.0%} of free memory; lower the ceiling only if the KV cache needs it")
    else:
        head = (f"Breakable graphs do not pay here: {fmt(speedup)}x {where} ({bound}); use backend eager")
    gap = t.get("launch_gap_share")
    if not pays and gap is not None:
        head += f" - the eager forward is only {gap:.0%} launch gap"
    label = "= chunked_prefill_size" if ceiling == chunk else "covers every forward of this workload"
    tail = (f"; if you do use them, set the capture ceiling to {ceiling} ({label}): "
            f"{cov['graph_fraction']:.0%} of forwards replay, {len(cov['never_fired'])} of "
            f"{cov['num_buckets']} buckets never fire")
    if pays and not too_big:
        tail = tail.replace("if you do use them, set", "set")
    sentence = head + tail + "."
    if a["environment"].get("emulated"):
        # CPU timings carry no launch overhead, so they cannot say whether graphs pay on a GPU.
        pays = None
        sentence = (f"CPU emulation: these timings show no kernel-launch overhead, so whether breakable graphs pay "
                    f"cannot be judged here (measured {fmt(speedup)}x, {bound} {where}); run bcg analyze on the "
                    f"GPU. On this workload set the capture ceiling to {ceiling} ({label}): "
                    f"{cov['graph_fraction']:.0%} of forwards replay, {len(cov['never_fired'])} of "
                    f"{cov['num_buckets']} buckets never fire.")
    return {"pays": pays, "recommended_ceiling": ceiling, "sentence": sentence}


def run_analyze(cfg: AnalyzeConfig, environment: dict[str, Any]) -> dict[str, Any]:
    """Runs every measurement of ``bcg analyze`` for a resolved ``cfg``; returns the analysis as plain data.

    Example::

        a = run_analyze(AnalyzeConfig(model="tiny-dense", device="cpu").resolved(), environment={})
        a["amdahl"]["p"], a["verdict"]["sentence"]
    """
    chunk, length = cfg.chunked_prefill_size, cfg.length
    lengths = cfg.lengths or sample_lengths(cfg.num_prompts, 16, chunk, cfg.seed)
    common = dict(device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, chunked_prefill_size=chunk,
                  progress=cfg.progress)
    a: dict[str, Any] = {"schema": "bcg.analyze/1", "kind": "analyze", "environment": environment}
    timing: dict[str, Any] = {"length": length}
    record = BuildRecord("breakable")
    # Breakable first, eager (with the profiler) last: CUPTI then never runs before a graph capture.
    with engine_for(cfg.model, "breakable", max_tokens=cfg.max_tokens, record=record, **common) as eng:
        if eng is None:
            raise RuntimeError(f"could not build the breakable engine: {record.error}")
        a["model"] = _describe_model(eng, cfg.model)
        prompt = make_prompts([length], eng.model.config.vocab_size, cfg.seed)[0]
        timing["breakable_forward_ms"], _ = _forward_time(eng, prompt, cfg, kernel=False)
        replay = _replay_breakdown(eng, prompt, cfg)
        a["coverage"] = _coverage(eng, lengths, chunk)
        a["memory"] = _memory(eng, record)
    del eng
    with engine_for(cfg.model, "eager", max_tokens=chunk, **common) as eng:
        if eng is None:
            raise RuntimeError(f"could not build the eager engine for {cfg.model!r}")
        timing["eager_forward_ms"], timing["eager_kernel_ms"] = _forward_time(eng, prompt, cfg, kernel=True)
    del eng
    a["build"] = vars(record)
    timing["launch_gap_share"] = amdahl.launch_gap_share(timing["eager_kernel_ms"], timing["eager_forward_ms"])
    timing["launch_bound"] = amdahl.launch_bound(timing["eager_forward_ms"], timing["eager_kernel_ms"])
    timing["measured_speedup"] = timing["eager_forward_ms"] / timing["breakable_forward_ms"]
    a["timing"], a["replay"] = timing, replay
    a["amdahl"] = _amdahl(timing, replay)
    a["verdict"] = verdict(a)
    return a


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


def format_analysis(a: dict[str, Any]) -> str:
    """The analysis as readable text: timing, islands, coverage, memory and the verdict."""
    t, am, rep, cov, mem = a["timing"], a["amdahl"], a["replay"], a["coverage"], a["memory"]
    m = a["model"]
    out = [f"bcg analyze: {m['name']} ({m['arch']}, {m['num_layers']} layers, {m['num_params'] / 1e6:.1f}M params, "
           f"{m['dtype']} on {m['device']})", ""]
    out.append(table(["quantity", "value"], [
        ["input length (tokens)", t["length"]],
        ["eager forward (ms)", fmt(t["eager_forward_ms"], 3)],
        ["eager kernel time (ms)", fmt(t["eager_kernel_ms"], 3)],
        ["launch-gap share", fmt(t["launch_gap_share"], 3)],
        ["bound without fusion (eager / kernel)", fmt(t.get("launch_bound"), 2, "x")],
        ["breakable forward (ms)", fmt(t["breakable_forward_ms"], 3)],
        ["p (island share of replay)", fmt(am.get("p"), 3)],
        ["S_max = 1/p", fmt(am.get("s_max"), 2, "x")],
        ["S_max over eager", fmt(am.get("s_max_over_eager"), 2, "x")],
        ["predicted speedup", fmt(am.get("predicted_speedup"), 2, "x")],
        ["measured speedup", fmt(t["measured_speedup"], 2, "x")],
        ["prediction error", fmt(am.get("prediction_error"), 3)],
    ], title="Timing and Amdahl"))
    if rep.get("bucket") is not None:
        rows = [[i["name"], i["count"], fmt(i["ms"], 3), fmt(i["share"], 3)] for i in rep["islands"]]
        rows.append(["(segments)", rep["num_segments"], fmt(rep["segments_ms"], 3), "-"])
        rows.append(["(outside graph)", "-", fmt(rep["outside_ms"], 3), "-"])
        out += ["", table(["step", "count", "ms", "share of replay"], rows,
                          title=f"Replay of bucket {rep['bucket']}: islands, costliest first")]
        ratio = rep["host_over_device"]
        bound = ("CPU emulation: the host runs everything" if a["environment"].get("emulated")
                 else "host-bound: cheaper islands would pay" if ratio > 0.9
                 else "device-bound: island host work is hidden")
        out.append(f"Replay launch on the host {fmt(rep['replay_host_ms'], 3)} ms vs {fmt(rep['replay_ms'], 3)} ms "
                   f"on the device (host/device {fmt(ratio, 2)}; {bound}).")
    never = cov["never_fired"]
    out += ["", table(["quantity", "value"], [
        ["prompts / forwards", f"{cov['num_prompts']} / {cov['num_forwards']}"],
        ["forwards replaying a graph", fmt(cov["graph_fraction"], 3)],
        ["tokens through a graph", fmt(cov["graph_token_fraction"], 3)],
        ["padding waste", fmt(cov["padding_waste"], 3)],
        ["ladder reaches chunk", f"{fmt(cov['reaches_chunk'])} (max bucket {cov['max_bucket']}, "
                                 f"chunk {cov['chunked_prefill_size']})"],
        ["eager reasons", ", ".join(f"{k}: {v}" for k, v in cov["eager_reasons"].items()) or "-"],
        ["buckets never fired", f"{len(never)} of {cov['num_buckets']}"
                                + (f" ({', '.join(map(str, never[:12]))}{' ...' if len(never) > 12 else ''})"
                                   if never else "")],
        ["resident graph memory", fmt_bytes(mem["graph_memory_bytes"])],
        ["free device memory", fmt_bytes(mem["free_bytes"])],
        ["graph share of free", fmt(mem["graph_share_of_free"], 4)],
    ], title="Coverage and memory")]
    out += ["", "Verdict: " + a["verdict"]["sentence"]]
    return "\n".join(out)
