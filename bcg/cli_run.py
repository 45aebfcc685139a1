"""The runs behind ``bcg bench`` and ``bcg analyze``: measure, write results.json and the PNGs, print the tables, and
return the one-line summary.

Apart from :mod:`bcg.cli`, which parses the flags into a config and sets the process up (device, threads, tensor
parallel group): each run here takes the resolved config and nothing else. As in :mod:`bcg.cli`, torch and the
measurement modules are imported only when a run starts.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["is_main_rank", "run_analyze", "run_bench"]


def _environment(device: str, emulated: bool) -> dict[str, Any]:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "cuda": torch.version.cuda, "device": device, "emulated": emulated, "device_name": "cpu",
           "torch_threads": torch.get_num_threads()}
    if not emulated:
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return env


def is_main_rank() -> bool:
    """Rank 0 of a tensor parallel run, or the only process: the one that prints and writes files."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _plot(kind: str, fn: Any, *args: Any) -> str | None:
    try:
        return str(fn(*args))
    except Exception as e:  # a failed figure must not lose the measurements
        print(f"bcg: could not draw the {kind} plot: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _title(cfg: Any, env: dict[str, Any]) -> str:
    return f"{cfg.model} on {env['device_name']}" + (" (CPU emulation)" if cfg.emulated else "")


def run_bench(cfg: Any) -> dict[str, Any]:
    """``bcg bench`` with a resolved :class:`~bcg.bench.config.BenchConfig`; returns the summary line's fields."""
    from bcg.bench import plots
    from bcg.bench.bench_report import CPU_PLOT_NOTE, CPU_SPEEDUP_NOTE, format_bench, geomean_speedups
    from bcg.bench.latency import run_latency
    from bcg.bench.memory import run_memory
    from bcg.bench.report import jsonable, write_json

    env = _environment(cfg.device, cfg.emulated)
    lat = run_latency(cfg)
    mem = (run_memory(cfg.model, cfg.device, cfg.dtype, cfg.seed, cfg.chunked_prefill_size, cfg.progress, cfg.tp,
                      cfg.model_impl) if cfg.memory else None)
    note = CPU_SPEEDUP_NOTE if cfg.emulated else None
    results: dict[str, Any] = {"schema": "bcg.bench/2", "kind": "bench", "config": vars(cfg), "environment": env,
                               "speedup_note": note, "builds": lat.builds, "rows": lat.rows,
                               "batch_rows": lat.batch_rows, "memory": mem}
    data = jsonable(results)
    out = Path(cfg.out)
    pngs: list[str] = []
    writes = is_main_rank()  # tensor parallel: only rank 0 writes files
    if cfg.plots and data["rows"] and writes:
        title = _title(cfg, env)
        pngs += [_plot("latency", plots.plot_latency, data["rows"], out / "latency.png", title),
                 _plot("speedup", plots.plot_speedup, data["rows"], out / "speedup.png",
                       title + (f"\n{CPU_PLOT_NOTE}" if cfg.emulated else ""))]
        if mem is not None and mem.available:
            pngs.append(_plot("memory", plots.plot_memory, data["memory"]["rows"], out / "memory.png", title))
    data["plots"] = [p for p in pngs if p]
    path = write_json(out / "results.json", data) if writes else None
    print(format_bench(cfg, lat, mem, cfg.emulated))
    return {"kind": "bench", "model": cfg.model, "device": env["device_name"], "emulated": cfg.emulated,
            "tp": cfg.tp, "lengths": cfg.lengths, "geomean_speedup": geomean_speedups(lat.rows, cfg.backends),
            "speedup_note": note, "unavailable": {b.backend: b.error for b in lat.builds if not b.available},
            "results": str(path), "plots": data["plots"]}


def run_analyze(cfg: Any) -> dict[str, Any]:
    """``bcg analyze`` with a resolved :class:`~bcg.bench.config.AnalyzeConfig`; returns the summary line's fields."""
    from bcg.bench import plots
    from bcg.bench.analyze import format_analysis, run_analyze
    from bcg.bench.report import jsonable, write_json

    env = _environment(cfg.device, cfg.emulated)
    a = run_analyze(cfg, env)
    a["config"] = vars(cfg)
    data = jsonable(a)
    out = Path(cfg.out)
    pngs = []
    if cfg.plots and a["replay"].get("bucket") is not None:
        pngs.append(_plot("analyze", plots.plot_analyze, data, out / "analyze.png", _title(cfg, env)))
    data["plots"] = [p for p in pngs if p]
    path = write_json(out / "results.json", data)
    print(format_analysis(a))
    am, t = a["amdahl"], a["timing"]
    return {"kind": "analyze", "model": cfg.model, "device": env["device_name"], "emulated": cfg.emulated,
            "p": am.get("p"), "s_max": am.get("s_max"), "launch_gap_share": t["launch_gap_share"],
            "predicted_speedup": am.get("predicted_speedup"), "measured_speedup": t["measured_speedup"],
            "prediction_error": am.get("prediction_error"), "coverage": a["coverage"]["graph_fraction"],
            "recommended_ceiling": a["verdict"]["recommended_ceiling"], "pays": a["verdict"]["pays"],
            "verdict": a["verdict"]["sentence"], "results": str(path), "plots": data["plots"]}
