"""The ``bcg`` command: ``bcg bench`` (latency, build and memory of every backend), ``bcg analyze`` (every backend
predicted before capture, and which one to use with which ceiling and buckets), ``bcg verify`` (where a graph
departs from eager) and ``bcg load`` (time to first token under an open-loop load, every backend side by side).

Every flag maps 1:1 to a field of :class:`~bcg.bench.config.BenchConfig`, :class:`~bcg.bench.config.AnalyzeConfig`,
:class:`~bcg.bench.config.VerifyConfig` or :class:`~bcg.bench.config.LoadConfig` (``--no-memory`` sets
``memory=False``), and its help shows its default.
Tables go to stdout, progress bars to stderr, and the last line printed is one JSON object summarising the run; the
full results are in ``--out``/results.json next to the PNGs. Under tensor parallel (``torchrun --nproc-per-node N -m
bcg bench --tp N``) every rank measures, and only rank 0 prints and writes files. This file parses the flags and
sets the process up; the runs themselves are :mod:`bcg.cli_run`'s, the verify flags :mod:`bcg.cli_verify`'s.
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

from bcg.cli_run import is_main_rank, run_analyze, run_bench, run_load

__all__ = ["build_parser", "main"]


def int_list(flag: str) -> Any:
    """An argparse type parsing a comma list of positive ints (``flag`` names it in argparse's errors)."""
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


def _size(text: str) -> int:
    from bcg.bench.checks import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def both(gpu: Any, cpu: Any) -> str:
    """A default that depends on the machine, as help text."""
    return f"{gpu} on CUDA, {cpu} on the CPU"


def engine_flags(p: argparse.ArgumentParser, model_help: str, model: str | None = None) -> None:
    """The flags every command shares: what runs, where, and with which chunk, seed and progress bars."""
    from bcg.bench.checks import DTYPES, MAX_CHUNK
    from bcg.bench.config import CPU_DEFAULTS as C
    from bcg.bench.config import CUDA_DEFAULTS as G
    from bcg.models.config import PRESETS
    from bcg.models.model_impl import MODEL_IMPLS

    p.add_argument("--model", default=model, help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face checkpoint "
                   f"folder (config.json and *.safetensors); default: {model_help}")
    p.add_argument("--model-impl", default="auto", choices=list(MODEL_IMPLS),
                   help="what runs a checkpoint folder: bcg's own model classes (native: llama, qwen3, qwen3_moe), "
                   "its transformers code as written (transformers), or native where bcg has the architecture "
                   "(auto) (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help=f"weights and activations (default: {both('bfloat16', 'float32')})")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help=f"tokens per forward, at most {MAX_CHUNK} (default: "
                   f"{both(G.chunked_prefill_size, C.chunked_prefill_size)}, for every command alike)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: on when stderr is a terminal, off in logs and pipes)")


def _measure_flags(p: argparse.ArgumentParser, out: str) -> None:
    """The flags of bench and analyze: how often to time, on how many threads, and where the results go."""
    from bcg.bench.config import CPU_DEFAULTS as C
    from bcg.bench.config import CUDA_DEFAULTS as G
    from bcg.bench.config import RUNS, WARMUP

    engine_flags(p, both(G.model, C.model))
    p.add_argument("--runs", type=int, default=RUNS,
                   help="timed runs per measurement; the median is reported with its interquartile range "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs before timing (default: %(default)s)")
    p.add_argument("--out", default=out, help="output folder for results.json and the PNGs, checked for writing "
                   "before anything runs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own on CUDA, 1 on the CPU: one thread keeps CPU "
                   "timings repeatable on a busy machine)")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="skip the PNGs, and remove those of an earlier run in --out (default: draw them)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``bcg`` (subcommands ``bench``, ``analyze`` and ``verify``, and ``--version``)."""
    from bcg import __version__
    from bcg.bench.config import CPU_DEFAULTS as C
    from bcg.bench.config import CUDA_DEFAULTS as G
    from bcg.bench.config import AnalyzeConfig, BenchConfig
    from bcg.cli_verify import add_parser as add_verify

    parser = argparse.ArgumentParser(prog="bcg", description="Breakable CUDA graphs for LLM prefill: measure "
                                     "and judge. Without a GPU every graph runs under the CPU emulation; its "
                                     "timings show no kernel-launch overhead.")
    parser.add_argument("--version", action="version", version=_version_line(__version__))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,analyze,verify,load}")
    bench = sub.add_parser("bench", help="isolated prefill latency, build time and memory of every backend",
                           description="One request at a time, fixed input lengths, every backend; plus a "
                           "many-request batch, build times, the device time of each row (CUDA) and the peak-memory "
                           "experiment (CUDA only; one chunk-sized prefill per capture ceiling).")
    _measure_flags(bench, "out/bench")
    bench.add_argument("--backends", type=_backend_list, default=None,
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
    _measure_flags(an, "out/analyze")
    from bcg.bench.config import ANALYZE_BACKENDS

    an.add_argument("--backends", type=_backend_list, default=None,
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
    an.add_argument("--memory-budget", type=_size, default=None,
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
    _add_load(sub)
    return parser


def _float_list(text: str) -> list[float]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers (e.g. 100,300,900)") from None
    if not values:
        raise argparse.ArgumentTypeError("empty; give e.g. 100,300,900")
    return values


def _add_load(sub: Any) -> None:
    """The flags of ``bcg load`` (:class:`~bcg.bench.config.LoadConfig`, one flag per field)."""
    from bcg.bench.config import LOAD_CPU_DEFAULTS as LC
    from bcg.bench.config import LOAD_CUDA_DEFAULTS as LG
    from bcg.bench.config import LoadConfig
    from bcg.runtime.config import SCHEDULE_POLICIES

    load = sub.add_parser("load", help="time to first token and throughput under an open-loop load",
                          description="Poisson arrivals at each offered rate (or a trace) through Engine.submit, "
                          "every backend in turn on the same requests: TTFT p50/p90/p99, queueing time and tokens/s "
                          "per backend and rate, a PNG of TTFT against offered load. A backend that falls behind a "
                          "rate stops there and skips its higher rates. On the CPU it is a smoke test.")
    engine_flags(load, both("llama-dense", "tiny-dense"))
    rates = ",".join(f"{r:g}" for r in LG.rates), ",".join(f"{r:g}" for r in LC.rates)
    variants = ",".join(LG.backends), ",".join(LC.backends)
    load.add_argument("--backends", type=_backend_list, default=None,
                      help=f"comma list of variants as in bench (default: {both(*variants)})")
    load.add_argument("--rates", type=_float_list, default=None,
                      help=f"offered loads in requests per second, comma list (default: {both(*rates)})")
    load.add_argument("--trace", default=None,
                      help="a file of requests, one 'ARRIVAL_S LENGTH' per line, instead of --rates and --lengths "
                      "(default: none)")
    load.add_argument("--duration", type=float, default=None,
                      help=f"seconds of arrivals per rate (default: {both(LG.duration, LC.duration)}; with --trace the "
                      "whole trace)")
    load.add_argument("--lengths", default=None,
                      help="prompt lengths: fixed:N, lognormal:MEDIAN (sigma 1, 16..4000) or lognormal:MEDIAN:MIN:MAX, "
                      f"or a file of lengths (default: {both(LG.lengths, LC.lengths)})")
    load.add_argument("--shared-prefix", type=int, default=0,
                      help="tokens every prompt opens with (a system prompt), before its own --lengths tokens "
                      "(default: %(default)s)")
    load.add_argument("--max-wait", type=float, default=None,
                      help="seconds a request may wait for its first token before the backend counts as fallen "
                      f"behind that rate (default: {both(LG.max_wait, LC.max_wait)})")
    load.add_argument("--warmup", type=int, default=16, help="requests run before each backend is measured "
                      "(default: %(default)s)")
    load.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                      help="reuse cached prompt prefixes (Engine(prefix_cache=...)) (default: on)")
    load.add_argument("--schedule-policy", default="fifo", choices=list(SCHEDULE_POLICIES),
                      help="order of admission of waiting requests (default: %(default)s)")
    load.add_argument("--tc-compiler", default="inductor", choices=("inductor", "traced"),
                      help="what compiles tc_piecewise's pieces (traced on a CPU) (default: %(default)s)")
    load.add_argument("--out", default="out/load", help="output folder for results.json and load.png "
                      "(default: %(default)s)")
    load.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: torch's own on CUDA, 1 on the CPU)")
    load.add_argument("--no-plots", dest="plots", action="store_false",
                      help="skip load.png, and remove that of an earlier run in --out (default: draw it)")
    load.set_defaults(func=run_load, parser=load, config=LoadConfig)


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
