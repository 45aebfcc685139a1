"""The ``bcg`` command: ``bcg bench`` (latency, build and memory of every backend), ``bcg analyze`` (every backend
predicted before capture, and which one to use with which ceiling and buckets), ``bcg verify`` (where a graph
departs from eager) and ``bcg load`` (time to first token under an open-loop load, every backend side by side).

Every flag maps 1:1 to a field of :class:`~bcg.bench.config.BenchConfig`, :class:`~bcg.bench.config.AnalyzeConfig`,
:class:`~bcg.bench.config.VerifyConfig` or :class:`~bcg.bench.load_config.LoadConfig` (``--no-memory`` sets
``memory=False``), and its help shows its default.
Tables go to stdout, progress bars to stderr, and the last line printed is one JSON object summarising the run; the
full results are in ``--out``/results.json next to the PNGs. Under tensor parallel (``torchrun --nproc-per-node N -m
bcg bench --tp N``) every rank measures, and only rank 0 prints and writes files. This file parses the flags and
sets the process up; the runs themselves are :mod:`bcg.cli.run`'s, the shared flags :mod:`bcg.cli.flags`'s and
the verify and load flags :mod:`bcg.cli.verify`'s and :mod:`bcg.cli.load`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from bcg.cli.flags import backend_list, both, int_list, measure_flags, size
from bcg.cli.run import is_main_rank, run_analyze, run_bench

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``bcg`` (subcommands ``bench``, ``analyze`` and ``verify``, and ``--version``)."""
    from bcg import __version__
    from bcg.bench.config import CPU_DEFAULTS as C
    from bcg.bench.config import CUDA_DEFAULTS as G
    from bcg.bench.config import AnalyzeConfig, BenchConfig
    from bcg.cli.load import add_parser as add_load
    from bcg.cli.verify import add_parser as add_verify

    parser = argparse.ArgumentParser(prog="bcg", description="Breakable CUDA graphs for LLM prefill: measure "
                                     "and judge. Without a GPU every graph runs under the CPU emulation; its "
                                     "timings show no kernel-launch overhead.")
    parser.add_argument("--version", action="version", version=_version_line(__version__))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,analyze,verify,load}")
    bench = sub.add_parser("bench", help="isolated prefill latency, build time and memory of every backend",
                           description="One request at a time, fixed input lengths, every backend; plus a "
                           "many-request batch, build times, the device time of each row (CUDA) and the peak-memory "
                           "experiment (CUDA only; one chunk-sized prefill per capture ceiling).")
    measure_flags(bench, "out/bench")
    bench.add_argument("--backends", type=backend_list, default=None,
                       help="comma list of variants: a backend (eager, breakable, full, tc_piecewise) with "
                       "optional +fused (fused kernels, else plain torch ops) and +inductor or +traced (the layer "
                       "stack compiled by Inductor, or traced by dynamo with no code generated: compile='inductor' "
                       "or 'traced'), e.g. breakable+fused (default: "
                       f"{both(','.join(G.backends), ','.join(C.backends))}); plain eager is always measured as "
                       "the baseline")
    bench.add_argument("--lengths", type=int_list("lengths"), default=None,
                       help=f"comma list of input lengths, each at most the model's context (default: "
                       f"{both(','.join(map(str, G.lengths)), ','.join(map(str, C.lengths)))})")
    bench.add_argument("--tc-compiler", default="inductor", choices=("inductor", "traced"),
                       help="what compiles tc_piecewise's pieces: inductor, or traced (dynamo's trace, no code "
                       "generated: what runs under the CPU emulation) (default: %(default)s)")
    bench.add_argument("--batch-requests", type=int, default=16,
                       help="requests in the extra many-request batch per length, 1 turns it off "
                       "(default: %(default)s)")
    bench.add_argument("--no-memory", dest="memory", action="store_false",
                       help="skip the memory experiment (default: run it on CUDA)")
    bench.add_argument("--no-profile", dest="profile", action="store_false",
                       help="skip the profiler: no device time, host overhead or kernel floor per row "
                       "(default: profile on CUDA)")
    bench.add_argument("--interleave", action="store_true",
                       help="build every variant first and time them in turn at each length, so drift of the "
                       "machine lands on all alike (default: build, measure and free one variant at a time)")
    bench.add_argument("--tp", type=int, default=1,
                       help="tensor parallel ranks; launch with torchrun --nproc-per-node TP (default: %(default)s)")
    bench.set_defaults(func=run_bench, parser=bench, config=BenchConfig)

    an = sub.add_parser("analyze", help="predict every backend before capturing anything, and recommend one",
                        description="Profiles one eager forward per length and microbenchmarks this machine's launch, "
                        "replay, break and capture costs, then predicts every backend's prefill latency, graph memory "
                        "and build time without capturing or compiling the model, and recommends a backend, a "
                        "capture ceiling and buckets for a workload under a graph-memory budget. The seed's four "
                        "parameters (launch-gap share, dynamic share, bucket coverage, resident graph memory) are "
                        "named in the report. --validate also captures and measures every backend.")
    measure_flags(an, "out/analyze")
    from bcg.bench.config import ANALYZE_BACKENDS

    an.add_argument("--backends", type=backend_list, default=None,
                    help="comma list of the variants to predict, named as in bench (e.g. breakable+fused, "
                    "tc_piecewise, breakable+inductor; eager, and eager+fused when a +fused variant is named, are "
                    "always measured) (default: "
                    f"{both(','.join(ANALYZE_BACKENDS['cuda']), ','.join(ANALYZE_BACKENDS['cpu']))})")
    an.add_argument("--lengths", type=int_list("lengths"), default=None,
                    help="the workload: prompt lengths, comma list (default: --num-prompts seeded log-uniform "
                    "lengths in 16..chunk)")
    an.add_argument("--lengths-file", default=None,
                    help="the workload from a file: lengths (one or more per line) or a trace of requests as JSON or "
                    "JSON lines (input_len, prompt_tokens, ... or the token ids) (replaces --lengths; default: none)")
    an.add_argument("--num-prompts", type=int, default=256, help="size of the default length sample "
                    "(default: %(default)s)")
    an.add_argument("--predict-lengths", type=int_list("predict-lengths"), default=None,
                    help="lengths every backend is predicted (and validated) at, each at most the chunk (default: "
                    f"{both(','.join(map(str, G.lengths)), ','.join(map(str, C.lengths)))})")
    an.add_argument("--length", type=int, default=None,
                    help=f"representative input length (the Amdahl point, the --cpu-cores table), at most "
                    f"--max-tokens (default: {both(G.length, C.length)})")
    an.add_argument("--max-tokens", type=int, default=None,
                    help="capture ceiling of the predicted (and validated) engines, at most the chunk size "
                    "(default: the chunk size)")
    an.add_argument("--tc-compiler", default=None, choices=("inductor", "traced"),
                    help="what compiles tc_piecewise's pieces (default: inductor on CUDA, traced on the CPU)")
    an.add_argument("--memory-budget", type=size, default=None,
                    help="most graph memory the recommendation may hold, e.g. 2GiB or 512MiB (default: a tenth of "
                    "the memory the weights leave free on CUDA, no limit on the CPU)")
    an.add_argument("--validate", action="store_true",
                    help="also build, capture and measure every backend, and print predicted and measured side by "
                    "side with the error (default: predict only, nothing captured or compiled)")
    an.add_argument("--cpu-cores", type=int_list("cpu-cores"), default=None,
                    help="comma list of core counts: repeat the host measurements (and with --validate the "
                    "measurements) with the process pinned to that many cores and as many torch threads "
                    "(default: the process as it is)")
    an.set_defaults(func=run_analyze, parser=an, config=AnalyzeConfig)
    add_verify(sub)
    add_load(sub)
    return parser


def _version_line(version: str) -> str:
    import torch

    return f"bcg {version} (distribution bcg-prefill; torch {torch.__version__})"


@contextlib.contextmanager
def _process(cfg: Any, parser: argparse.ArgumentParser) -> Iterator[None]:
    """Sets the process up for a run and restores it after: the CUDA device, the torch threads, the tensor parallel
    group (a launch without torchrun is a usage error), and stdout silenced on every rank but 0."""
    import torch

    if not cfg.emulated:
        # CUDA events and the profiler use the current device; make it the one measured (e.g. --device cuda:1).
        dev = torch.device(cfg.device)
        if dev.index is not None:
            torch.cuda.set_device(dev)
    owns_group = False
    if getattr(cfg, "tp", 1) > 1:  # tensor parallel: join the group now, so every rank knows whether it reports
        import torch.distributed as dist

        from bcg.ops.parallel import TensorParallelError, init_tensor_parallel

        owns_group = not dist.is_initialized()
        try:
            init_tensor_parallel(cfg.tp, torch.device(cfg.device))
        except TensorParallelError as e:
            parser.error(f"--tp {cfg.tp}: {e}")
    quiet = not is_main_rank()  # every rank measures; only rank 0 prints
    if quiet:
        cfg.progress = False
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            if getattr(cfg, "threads", None) is not None:
                torch.set_num_threads(cfg.threads)
            yield
    finally:
        torch.set_num_threads(threads)  # main() called as a function leaves the process as it found it
        if owns_group:
            from bcg.ops.parallel import shutdown_tensor_parallel

            shutdown_tensor_parallel()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bcg`` console script and ``python -m bcg``; returns the exit status.

    0: measured (verify: no divergence); 1: the run could not measure (e.g. the eager baseline failed to build, or
    no row was measured), or verify found a divergence, one line on stderr; 2: a bad flag, with the usage line and
    one line naming it (nothing has run yet); 130: interrupted (Ctrl-C).

    Example::

        main(["bench", "--device", "cpu", "--lengths", "16,32", "--runs", "2", "--out", "/tmp/b"])
    """
    from bcg.bench.checks import check_out_dir
    from bcg.bench.config import BenchError
    from bcg.bench.results import summary_line

    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = ns.config(**{f.name: getattr(ns, f.name) for f in fields(ns.config)}).resolved()
        if hasattr(cfg, "out"):
            check_out_dir(cfg.out)  # before the run: an unwritable folder must not cost its results
    except ValueError as e:
        ns.parser.error(str(e))  # exits 2 with the subcommand's usage line and the message on stderr
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        with _process(cfg, ns.parser):
            summary = ns.func(cfg)
            print(summary_line(summary))
    except BenchError as e:
        print(f"bcg {ns.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bcg {ns.command}: interrupted", file=sys.stderr)
        return 130
    return 1 if summary.get("ok") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
