"""The runs behind ``bcg bench``, ``bcg analyze``, ``bcg verify`` and ``bcg load``: each takes its resolved config,
prints the header, measures, writes results.json and the PNGs, prints the tables, and returns the fields of the
one-line summary.

Apart from :mod:`bcg.cli`, which parses the flags into a config and sets the process up (device, threads, tensor
parallel group). As in :mod:`bcg.cli`, torch and the measurement modules are imported only when a run starts.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

__all__ = ["is_main_rank", "run_analyze", "run_bench", "run_load", "run_verify"]


def is_main_rank() -> bool:
    """Rank 0 of a tensor parallel run, or the only process: the one that prints and writes files."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _environment(cfg: Any) -> dict[str, Any]:
    import torch

    from bcg.bench.checks import check_model

    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.version.cuda, "device": cfg.device, "emulated": cfg.emulated,
            "device_name": "cpu" if cfg.emulated else torch.cuda.get_device_name(torch.device(cfg.device)),
            "torch_threads": torch.get_num_threads(), "model_impl": check_model(cfg.model, cfg.model_impl)}


def _title(cfg: Any, env: dict[str, Any]) -> str:
    return f"{cfg.model} on {env['device_name']}" + (" (CPU emulation)" if cfg.emulated else "")


def run_bench(cfg: Any) -> dict[str, Any]:
    """``bcg bench`` with a resolved :class:`~bcg.bench.config.BenchConfig`."""
    from bcg.bench import plots, text
    from bcg.bench.config import BenchError
    from bcg.bench.latency import run_latency
    from bcg.bench.memory import run_memory
    from bcg.bench.results import bench_results, bench_summary, write_json

    env = _environment(cfg)
    print(text.header("bench", cfg, env), flush=True)
    lat = run_latency(cfg)
    mem = run_memory(cfg.engine_spec()) if cfg.memory else None
    results = bench_results(cfg, env, lat, mem)
    path = None
    if is_main_rank():  # tensor parallel: every rank measures, rank 0 writes
        figures = plots.bench_figures(results, _title(cfg, env)) if cfg.plots else {}
        results["plots"] = plots.write_plots(figures, cfg.out, plots.BENCH_PLOTS)
        path = write_json(Path(cfg.out) / "results.json", results)
    print(text.format_bench(cfg, lat, mem, cfg.emulated))
    asked = [b for b in cfg.backends if b != "eager"]
    refused = {b.backend: b.error for b in lat.builds if not b.available}
    if asked and all(b in refused for b in asked):  # eager alone was measured: the run measured nothing asked of it
        reasons = "; ".join(f"{b}: {refused[b]}" for b in asked)
        raise BenchError(f"no backend asked for could be measured, only the eager baseline ({reasons})")
    return bench_summary(cfg, results, lat, path)


def run_analyze(cfg: Any) -> dict[str, Any]:
    """``bcg analyze`` with a resolved :class:`~bcg.bench.config.AnalyzeConfig`."""
    from bcg.bench import analysis_plots, analyze, plots, text
    from bcg.bench.results import analyze_summary, jsonable, write_json

    env = _environment(cfg)
    print(text.header("analyze", cfg, env), flush=True)
    a = analyze.run_analyze(cfg, env)
    a["config"] = vars(cfg)
    inputs = a.pop("inputs")  # kept apart: a GPU run's traces are megabytes, results.json stays readable
    a["inputs_file"] = str(write_json(Path(cfg.out) / "inputs.json", inputs, indent=None))
    data = jsonable(a)
    figures = analysis_plots.analyze_figures(data, _title(cfg, env)) if cfg.plots else {}
    data["plots"] = plots.write_plots(figures, cfg.out, analysis_plots.ANALYZE_PLOTS)
    path = write_json(Path(cfg.out) / "results.json", data)
    print(text.format_analysis(data))
    return analyze_summary(cfg, data, path)


def run_verify(cfg: Any) -> dict[str, Any]:
    """``bcg verify`` with a resolved :class:`~bcg.bench.verify_config.VerifyConfig`: one report per batch size on
    stdout; the summary's ``ok`` is False when a bucket diverges or no batch size replays a graph (exit status 1)."""
    from bcg.bench.config import BenchError
    from bcg.errors import first_line
    from bcg.ops.kv_cache import KVPoolFullError
    from bcg.runtime import Engine
    from bcg.runtime.runner.verify import verify_segments

    config = cfg.engine_config()
    try:
        engine = Engine(cfg.model, config)
    except Exception as e:  # a model that cannot be built is one line, as in bench and analyze
        raise BenchError(f"the {config.backend} engine of {cfg.model!r} could not be built ({first_line(e)})") from e
    reports, skipped = [], {}
    for n in cfg.num_tokens or sorted(engine.runner.handles):
        try:
            report = verify_segments(engine.runner, n, cfg.tolerance, cfg.seed)
        except (ValueError, KVPoolFullError) as e:  # this size runs eagerly, or does not fit: nothing to compare
            skipped[n] = str(e)
            print(f"{n} tokens: skipped, {e}")
            continue
        reports.append(report)
        print(report)
    if not reports:
        raise BenchError(_nothing_verified(cfg, engine, skipped))
    return {"kind": "verify", "model": str(cfg.model), "backend": config.backend,
            "ok": bool(reports) and all(r.ok for r in reports), "buckets": sorted({r.bucket for r in reports}),
            "skipped": skipped, "max_diff": max((r.max_diff for r in reports), default=None),
            "first_divergence": {str(r.bucket): r.to_dict()["first_divergence"] for r in reports if not r.ok}}


def _nothing_verified(cfg: Any, engine: Any, skipped: dict[int, str]) -> str:
    """The error of a verify run in which no size replayed a graph: why, and the flag that changes it."""
    if not skipped:
        table = engine.runner.table
        reasons = [b.record.disabled_reason for b in table.buckets.values() if b.record.disabled_reason]
        why = f" ({table.refused_reason or reasons[0]})" if table.refused_reason or reasons else ""
        return f"the {cfg.backend} engine captured no bucket{why}, so there is nothing to verify"
    reason = next(iter(skipped.values()))
    hint = "see the reasons above"
    if "too_many_requests" in reason:
        hint = "give --max-requests 2 or more (each size is checked with a batch of 2 requests)"
    elif "exceeds_max_bucket" in reason or "no_bucket" in reason:
        hint = "give --num-tokens up to the largest bucket, or capture larger ones (--buckets, --max-tokens)"
    elif "backend_refused" in reason:
        hint = "the engine's reason is logged above"
    return f"no batch size replays a graph ({len(skipped)} skipped, e.g. {reason}); {hint}"


def run_load(cfg: Any) -> dict[str, Any]:
    """``bcg load`` with a resolved :class:`~bcg.bench.load_config.LoadConfig`: header, every variant at every rate,
    results.json and load.png, the table; raises BenchError when no variant could be measured (exit status 1)."""
    import sys

    from bcg.bench import load_report, plots
    from bcg.bench.config import BenchError
    from bcg.bench.load_run import run_load as measure
    from bcg.bench.results import write_json

    env = _environment(cfg)
    lengths = cfg.length_spec.describe() if cfg.length_spec is not None else "of the trace's lengths"
    workload = {"lengths": lengths, "shared_prefix": cfg.shared_prefix, "rates": cfg.rates, "trace": cfg.trace,
                "duration_s": cfg.duration}
    print(load_report.load_header(cfg, env, workload), flush=True)

    def progress(text: str) -> None:
        if cfg.progress:
            print(f"bcg load: {text}", file=sys.stderr, flush=True)

    result = measure(cfg, progress)
    workload["per_rate"] = result.workloads
    if not any(r.completed for r in result.rows):
        reasons = "; ".join(f"{b.backend}: {b.error}" for b in result.builds if b.error) or "no request was answered"
        raise BenchError(f"no variant could be measured ({reasons})")
    results = load_report.load_results(cfg, env, workload, result)
    note = load_report.CPU_LOAD_NOTE if cfg.emulated else None
    figures = {"load.png": lambda: load_report.load_figure(results["rows"], _title(cfg, env), note)} if cfg.plots \
        else {}
    results["plots"] = plots.write_plots(figures, cfg.out, load_report.LOAD_PLOTS)
    path = write_json(Path(cfg.out) / "results.json", results)
    print(load_report.format_load(result.rows, result.builds, result.warmups))
    return load_report.load_summary(cfg, results, path)
