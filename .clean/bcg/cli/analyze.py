"""The flags of ``bcg analyze``: every backend predicted before capture, and which one to use with which ceiling and
buckets.

Each flag maps 1:1 to a field of :class:`~bcg.bench.config.AnalyzeConfig`; the run is
:func:`bcg.cli.run.run_analyze`.
"""

from __future__ import annotations

import argparse

from bcg.cli.flags import backend_list, both, int_list, measure_flags, size, tc_compiler_flag

__all__ = ["add_flags"]

HELP = "predict every backend before capturing anything, and recommend one"


def add_flags(an: argparse.ArgumentParser) -> None:
    """Fills in the ``analyze`` subcommand's parser (:class:`~bcg.bench.config.AnalyzeConfig`, one flag per field)."""
    from bcg.bench.defaults import ANALYZE_BACKENDS, ANALYZE_RUNS, ANALYZE_WARMUP, MACHINE_CACHE_MODES
    from bcg.bench.defaults import CPU_DEFAULTS as C
    from bcg.bench.defaults import CUDA_DEFAULTS as G
    from bcg.cli.run import run_analyze

    an.description = ("Profiles one eager forward per length and microbenchmarks this machine's launch, replay, "
                      "break and capture costs, then predicts every backend's prefill latency, graph memory and "
                      "build time without capturing or compiling the model, and recommends a backend, a capture "
                      "ceiling and buckets for a workload under a graph-memory budget. The seed's four parameters "
                      "(launch-gap share, dynamic share, bucket coverage, resident graph memory) are named in the "
                      "report. --validate also captures and measures every backend.")
    measure_flags(an, "out/analyze", ANALYZE_RUNS, ANALYZE_WARMUP)
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
    tc_compiler_flag(an)
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
    an.add_argument("--machine-cache", choices=MACHINE_CACHE_MODES, default="use",
                    help="this machine's microbenchmarks and replay-path costs (they do not depend on the model) from "
                    "the disk cache ($XDG_CACHE_HOME/bcg, else ~/.cache/bcg) where an entry matches this device, "
                    "torch, triton, cores and threads, measured and kept where none does: use; measure again and "
                    "overwrite: refresh; neither read nor write: off (default: %(default)s)")
    an.set_defaults(func=run_analyze, parser=an, config="bcg.bench.config:AnalyzeConfig")
