"""The ``bcg`` command: ``bcg bench`` (latency, build and memory of every backend), ``bcg analyze`` (should
this model use breakable graphs here, and with which ceiling) and ``bcg verify`` (where a graph departs from eager,
:mod:`bcg.cli_verify`).

Every flag maps 1:1 to a field of :class:`~bcg.bench.config.BenchConfig` or :class:`~bcg.bench.config.AnalyzeConfig`
(``--no-memory`` sets ``memory=False``). Tables go to stdout, progress bars to stderr, and the last line printed is
one JSON object summarising the run; the full results are in ``--out``/results.json next to the PNGs.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def _int_list(what: str) -> Any:
    def parse(text: str) -> list[int]:
        from bcg.bench.config import parse_int_list

        try:
            return parse_int_list(text, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = what  # argparse names the type in its error message
    return parse


def _backend_list(text: str) -> list[str]:
    from bcg.runtime.config import resolve_backend

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--backends is empty; give e.g. eager,breakable")
    try:
        return [resolve_backend(n) for n in names]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _common(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--model", default=None,
                   help="preset name or checkpoint folder (default: llama-dense on CUDA, tiny-dense on CPU)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per measurement (median is reported)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before timing")
    p.add_argument("--out", default=out, help=f"output folder for results.json and PNGs (default {out})")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``bcg`` (subcommands ``bench``, ``analyze`` and ``verify``)."""
    parser = argparse.ArgumentParser(prog="bcg", description="Breakable CUDA graphs for LLM prefill: measure "
                                     "and judge.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,analyze,verify}")
    bench = sub.add_parser("bench", help="isolated prefill latency, build time and memory of every backend",
                           description="One request at a time, fixed input lengths, every backend; plus a "
                           "many-request batch, build times and the peak-memory experiment.")
    _common(bench, "out/bench")
    bench.add_argument("--backends", type=_backend_list, default=None,
                       help="comma list of eager,breakable,full,tc_piecewise (default: all four on CUDA, "
                       "eager,breakable on CPU); eager is always measured as the baseline")
    bench.add_argument("--lengths", type=_int_list("lengths"), default=None,
                       help="comma list of input lengths (default 64,...,2048 on CUDA; 16,...,128 on CPU)")
    bench.add_argument("--chunked-prefill-size", type=int, default=2048,
                       help="tokens per forward; also the prefill size of the memory experiment")
    bench.add_argument("--batch-requests", type=int, default=16,
                       help="requests in the extra many-request batch per length (1 turns it off)")
    bench.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory experiment")
    bench.add_argument("--no-profile", dest="profile", action="store_false",
                       help="skip the profiler's kernel floor")
    bench.set_defaults(func=_run_bench, parser=bench)

    an = sub.add_parser("analyze", help="measure p, launch gap, coverage and graph memory; give a verdict",
                        description="Measures the launch-gap share, the island share p of a breakable replay, "
                        "bucket coverage of a prompt-length distribution and resident graph memory, then says "
                        "whether breakable graphs pay and which capture ceiling to use.")
    _common(an, "out/analyze")
    an.add_argument("--lengths", type=_int_list("lengths"), default=None,
                    help="prompt-length distribution, comma list (default: seeded log-uniform 16..chunk)")
    an.add_argument("--lengths-file", default=None, help="prompt lengths, one or more per line")
    an.add_argument("--num-prompts", type=int, default=256, help="size of the default length sample")
    an.add_argument("--length", type=int, default=None,
                    help="representative input length for the timings (default 512 on CUDA, 64 on CPU)")
    an.add_argument("--max-tokens", type=int, default=None, help="capture ceiling (default: the chunk size)")
    an.add_argument("--chunked-prefill-size", type=int, default=None,
                    help="tokens per forward (default 2048 on CUDA, 256 on CPU)")
    an.set_defaults(func=_run_analyze, parser=an)
    from bcg.cli_verify import add_parser as add_verify

    add_verify(sub, _int_list)
    return parser


def _config(cls: type, ns: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def _environment(device: str, emulated: bool) -> dict[str, Any]:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "cuda": torch.version.cuda, "device": device, "emulated": emulated, "device_name": "cpu"}
    if not emulated:
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return env


def _plot(kind: str, fn: Any, *args: Any) -> str | None:
    try:
        return str(fn(*args))
    except Exception as e:  # noqa: BLE001 - a failed figure must not lose the measurements
        print(f"bcg: could not draw the {kind} plot: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _run_bench(cfg: Any) -> dict[str, Any]:
    from bcg.bench import plots
    from bcg.bench.latency import run_latency
    from bcg.bench.memory import run_memory
    from bcg.bench.report import fmt, fmt_bytes, jsonable, table, write_json

    env = _environment(cfg.device, cfg.emulated)
    lat = run_latency(cfg)
    mem = (run_memory(cfg.model, cfg.device, cfg.dtype, cfg.seed, cfg.chunked_prefill_size, cfg.progress)
           if cfg.memory else None)
    results: dict[str, Any] = {"schema": "bcg.bench/1", "kind": "bench", "config": vars(cfg), "environment": env,
                               "builds": lat.builds, "rows": lat.rows, "batch_rows": lat.batch_rows,
                               "memory": mem}
    data = jsonable(results)
    out = Path(cfg.out)
    pngs: list[str] = []
    if cfg.plots:
        title = f"{cfg.model} on {env['device_name']}" + (" (CPU emulation)" if cfg.emulated else "")
        pngs += [_plot("latency", plots.plot_latency, data["rows"], out / "latency.png", title),
                 _plot("speedup", plots.plot_speedup, data["rows"], out / "speedup.png", title)]
        if mem is not None and mem.available:
            pngs.append(_plot("memory", plots.plot_memory, data["memory"]["rows"], out / "memory.png", title))
    data["plots"] = [p for p in pngs if p]
    path = write_json(out / "results.json", data)

    print(table(["backend", "available", "build ms", "compile ms", "capture ms", "buckets", "segs/breaks",
                 "graph mem", "note"],
                [[b.backend, fmt(b.available), fmt(b.build_ms, 0), fmt(b.compile_ms, 0), fmt(b.capture_ms, 0),
                  f"{b.num_captured}/{b.num_buckets}", f"{fmt(b.num_segments)}/{fmt(b.num_breaks)}",
                  fmt_bytes(b.graph_memory_bytes), (b.error or b.refused_reason or "")[:60]]
                 for b in lat.builds], title="Build"))
    for title, rows in (("Latency, one request", lat.rows), (f"Latency, {cfg.batch_requests} requests "
                                                               "(same total tokens)", lat.batch_rows)):
        if rows:
            print()
            print(table(["backend", "tokens", "reqs", "median ms", "min ms", "speedup", "kernel floor",
                         "launch gap", "graph"],
                        [[r.backend, r.num_tokens, r.num_requests, fmt(r.median_ms, 3), fmt(r.min_ms, 3),
                          fmt(r.speedup_vs_eager, 2, "x"), fmt(r.kernel_floor_ms, 3), fmt(r.launch_gap_share, 2),
                          "yes" if r.graph_used else r.reason] for r in rows], title=title))
    if mem is not None:
        print()
        if mem.available:
            print(table(["ceiling", "backend", "buckets", "graph mem", "activation peak", "total above base",
                         "replayed"],
                        [[r.label if r.ceiling is None else f"{r.label} ({r.ceiling})", r.backend, r.num_buckets,
                          fmt_bytes(r.graph_memory_bytes), fmt_bytes(r.activation_peak_bytes),
                          fmt_bytes(r.device_used_above_baseline_bytes), fmt(r.graph_used)] for r in mem.rows],
                        title=f"Memory after one {mem.chunked_prefill_size}-token prefill"))
        else:
            print(f"Memory: {mem.note}")
    speedups: dict[str, float | None] = {}
    for b in cfg.backends:
        vals = [r.speedup_vs_eager for r in lat.rows if r.backend == b and r.speedup_vs_eager]
        speedups[b] = statistics.geometric_mean(vals) if vals else None
    return {"kind": "bench", "model": cfg.model, "device": env["device_name"], "emulated": cfg.emulated,
            "lengths": cfg.lengths, "geomean_speedup": speedups,
            "unavailable": {b.backend: b.error for b in lat.builds if not b.available},
            "results": str(path), "plots": data["plots"]}


def _run_analyze(cfg: Any) -> dict[str, Any]:
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
        title = f"{cfg.model} on {env['device_name']}" + (" (CPU emulation)" if cfg.emulated else "")
        pngs.append(_plot("analyze", plots.plot_analyze, data, out / "analyze.png", title))
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bcg`` console script and ``python -m bcg``; returns the exit status.

    Example::

        main(["bench", "--device", "cpu", "--lengths", "16,32", "--runs", "2", "--out", "/tmp/b"])
    """
    from bcg.bench.config import CPU_BANNER, AnalyzeConfig, BenchConfig
    from bcg.bench.report import summary_line

    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "verify":
        from bcg.cli_verify import run as run_verify

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        return run_verify(ns)
    cls = BenchConfig if ns.command == "bench" else AnalyzeConfig
    try:
        cfg = _config(cls, ns).resolved()
    except ValueError as e:
        ns.parser.error(str(e))  # exits 2 with the subcommand's usage line and the message on stderr
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not cfg.emulated:
        import torch

        # CUDA events and the profiler use the current device; make it the one measured (e.g. --device cuda:1).
        dev = torch.device(cfg.device)
        if dev.index is not None:
            torch.cuda.set_device(dev)
    if cfg.emulated:
        print(CPU_BANNER)
    summary = ns.func(cfg)
    print(summary_line(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
