"""The ``bcg`` command: ``bcg bench`` (latency, build and memory of every backend), ``bcg analyze`` (should
this model use breakable graphs here, and with which ceiling) and ``bcg verify`` (where a graph departs from eager,
:mod:`bcg.cli_verify`).

Every flag maps 1:1 to a field of :class:`~bcg.bench.config.BenchConfig` or :class:`~bcg.bench.config.AnalyzeConfig`
(``--no-memory`` sets ``memory=False``). Tables go to stdout, progress bars to stderr, and the last line printed is
one JSON object summarising the run; the full results are in ``--out``/results.json next to the PNGs. Under
tensor parallel (``torchrun --nproc-per-node N -m bcg bench --tp N``) every rank measures, and only rank 0 prints and
writes files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import platform
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def _int_list(flag: str) -> Any:
    def parse(text: str) -> list[int]:
        from bcg.bench.checks import parse_int_list

        try:
            return parse_int_list(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None  # argparse prefixes "argument --flag:"

    parse.__name__ = flag  # argparse names the type in its error message
    return parse


def _backend_list(text: str) -> list[str]:
    from bcg.bench.variants import parse_variant

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("empty; give e.g. eager,breakable")
    try:
        return [parse_variant(n).name for n in names]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _both(gpu: Any, cpu: Any) -> str:
    return f"{gpu} on CUDA, {cpu} on the CPU"


def _common(p: argparse.ArgumentParser, out: str) -> None:
    from bcg.bench.config import CPU_DEFAULTS as C
    from bcg.bench.config import CUDA_DEFAULTS as G
    from bcg.bench.config import MAX_CHUNK, RUNS, WARMUP
    from bcg.models.config import PRESETS
    from bcg.models.model_impl import MODEL_IMPLS

    p.add_argument("--model", default=None,
                   help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face checkpoint folder (config.json and "
                   f"*.safetensors); default: {_both(G.model, C.model)}")
    p.add_argument("--model-impl", default="auto", choices=list(MODEL_IMPLS),
                   help="what runs a checkpoint folder: bcg's own model classes (native: llama, qwen3, qwen3_moe), "
                   "its transformers code as written (transformers), or native where bcg has the architecture "
                   "(auto, the default)")
    p.add_argument("--runs", type=int, default=RUNS,
                   help="timed runs per measurement; the median is reported with its interquartile range "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs before timing (default: %(default)s)")
    p.add_argument("--out", default=out, help="output folder for results.json and the PNGs, checked for writing "
                   "before anything runs (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help=f"weights and activations (default: {_both('bfloat16', 'float32')})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own on CUDA, 1 on the CPU: one thread keeps CPU "
                   "timings repeatable on a busy machine)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help=f"tokens per forward, at most {MAX_CHUNK} (default: "
                   f"{_both(G.chunked_prefill_size, C.chunked_prefill_size)}, for bench and analyze alike)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and prompts (default: %(default)s)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: on when stderr is a terminal, off in logs and pipes)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``bcg`` (subcommands ``bench``, ``analyze`` and ``verify``, and ``--version``)."""
    from bcg import __version__
    from bcg.bench.config import CPU_DEFAULTS as C
    from bcg.bench.config import CUDA_DEFAULTS as G

    parser = argparse.ArgumentParser(prog="bcg", description="Breakable CUDA graphs for LLM prefill: measure "
                                     "and judge. Without a GPU every graph runs under the CPU emulation; its "
                                     "timings show no kernel-launch overhead.")
    parser.add_argument("--version", action="version", version=_version_line(__version__))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,analyze,verify}")
    bench = sub.add_parser("bench", help="isolated prefill latency, build time and memory of every backend",
                           description="One request at a time, fixed input lengths, every backend; plus a "
                           "many-request batch, build times and the peak-memory experiment (CUDA only; one "
                           "chunk-sized prefill per capture ceiling).")
    _common(bench, "out/bench")
    bench.add_argument("--backends", type=_backend_list, default=None,
                       help=f"comma list of variants: a backend (eager, breakable, full, tc_piecewise) with "
                       "optional +fused (fused kernels, else plain torch ops) and +inductor or +traced (compile the "
                       "layer stack), e.g. breakable+fused (default: "
                       f"{_both(','.join(G.backends), ','.join(C.backends))}); plain eager is always measured as "
                       "the baseline")
    bench.add_argument("--lengths", type=_int_list("lengths"), default=None,
                       help=f"comma list of input lengths (default: "
                       f"{_both(','.join(map(str, G.lengths)), ','.join(map(str, C.lengths)))})")
    bench.add_argument("--batch-requests", type=int, default=16,
                       help="requests in the extra many-request batch per length, 1 turns it off "
                       "(default: %(default)s)")
    bench.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory experiment")
    bench.add_argument("--no-profile", dest="profile", action="store_false",
                       help="skip the profiler's kernel floor")
    bench.add_argument("--tp", type=int, default=1,
                       help="tensor parallel ranks; launch with torchrun --nproc-per-node TP (default 1)")
    bench.set_defaults(func=_run_bench, parser=bench)

    an = sub.add_parser("analyze", help="measure p, launch gap, coverage and graph memory; give a verdict",
                        description="Measures the launch-gap share, the island share p of a breakable replay, "
                        "bucket coverage of a prompt-length distribution and resident graph memory, then says "
                        "whether breakable graphs pay and which capture ceiling to use.")
    _common(an, "out/analyze")
    an.add_argument("--lengths", type=_int_list("lengths"), default=None,
                    help="prompt-length distribution, comma list (default: --num-prompts seeded log-uniform "
                    "lengths in 16..chunk)")
    an.add_argument("--lengths-file", default=None,
                    help="prompt lengths, one or more per line (replaces --lengths)")
    an.add_argument("--num-prompts", type=int, default=256, help="size of the default length sample "
                    "(default: %(default)s)")
    an.add_argument("--length", type=int, default=None,
                    help=f"representative input length for the timings, at most --max-tokens (default: "
                    f"{_both(G.length, C.length)})")
    an.add_argument("--max-tokens", type=int, default=None,
                    help="capture ceiling, at most the chunk size (default: the chunk size)")
    an.set_defaults(func=_run_analyze, parser=an)
    from bcg.cli_verify import add_parser as add_verify

    add_verify(sub, _int_list)
    return parser


def _version_line(version: str) -> str:
    import torch

    return f"bcg {version} (distribution bcg-prefill; torch {torch.__version__})"


def _config(cls: type, ns: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def _environment(device: str, emulated: bool) -> dict[str, Any]:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "cuda": torch.version.cuda, "device": device, "emulated": emulated, "device_name": "cpu",
           "torch_threads": torch.get_num_threads()}
    if not emulated:
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return env


def _is_main_rank() -> bool:
    """Rank 0 of a tensor parallel run, or the only process: the one that prints and writes files."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _plot(kind: str, fn: Any, *args: Any) -> str | None:
    try:
        return str(fn(*args))
    except Exception as e:  # noqa: BLE001 - a failed figure must not lose the measurements
        print(f"bcg: could not draw the {kind} plot: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _title(cfg: Any, env: dict[str, Any]) -> str:
    return f"{cfg.model} on {env['device_name']}" + (" (CPU emulation)" if cfg.emulated else "")


def _run_bench(cfg: Any) -> dict[str, Any]:
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
    writes = _is_main_rank()  # tensor parallel: only rank 0 writes files
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bcg`` console script and ``python -m bcg``; returns the exit status.

    0: measured; 1: the run could not measure (e.g. the eager baseline failed to build), one line on stderr;
    2: a bad flag, with the usage line and one line naming it (nothing has run yet).

    Example::

        main(["bench", "--device", "cpu", "--lengths", "16,32", "--runs", "2", "--out", "/tmp/b"])
    """
    from bcg.bench.checks import check_out_dir
    from bcg.bench.config import AnalyzeConfig, BenchConfig, BenchError, cpu_banner
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
        check_out_dir(cfg.out)  # before the run: an unwritable folder must not cost its results
    except ValueError as e:
        ns.parser.error(str(e))  # exits 2 with the subcommand's usage line and the message on stderr
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch

    if not cfg.emulated:
        # CUDA events and the profiler use the current device; make it the one measured (e.g. --device cuda:1).
        dev = torch.device(cfg.device)
        if dev.index is not None:
            torch.cuda.set_device(dev)
    owns_group = False
    if getattr(cfg, "tp", 1) > 1:  # tensor parallel: join the group now, so every rank knows whether it reports
        import torch.distributed as dist

        from bcg.ops.parallel import init_tensor_parallel

        owns_group = not dist.is_initialized()
        init_tensor_parallel(cfg.tp, torch.device(cfg.device))
    quiet = not _is_main_rank()  # every rank measures; only rank 0 prints
    if quiet:
        cfg.progress = False
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            if cfg.threads is not None:
                torch.set_num_threads(cfg.threads)
            if cfg.emulated:
                print(cpu_banner(ns.command, cfg.model, torch.get_num_threads()))
            try:
                summary = ns.func(cfg)
            except BenchError as e:
                print(f"bcg {ns.command}: error: {e}", file=sys.stderr)
                return 1
            print(summary_line(summary))
    finally:
        torch.set_num_threads(threads)  # main() called as a function leaves the process as it found it
        if owns_group:
            from bcg.ops.parallel import shutdown_tensor_parallel

            shutdown_tensor_parallel()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
