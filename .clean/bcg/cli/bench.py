"""The flags of ``bcg bench``: isolated prefill latency, build time and memory of every backend.

Each flag maps 1:1 to a field of :class:`~bcg.bench.config.BenchConfig`; the run is :func:`bcg.cli.run.run_bench`.
"""

from __future__ import annotations

import argparse

from bcg.cli.flags import backend_list, both, int_list, measure_flags, tc_compiler_flag

__all__ = ["add_flags"]

HELP = "isolated prefill latency, build time and memory of every backend"


def add_flags(bench: argparse.ArgumentParser) -> None:
    """Fills in the ``bench`` subcommand's parser (:class:`~bcg.bench.config.BenchConfig`, one flag per field)."""
    from bcg.bench.defaults import CPU_DEFAULTS as C
    from bcg.bench.defaults import CUDA_DEFAULTS as G
    from bcg.cli.run import run_bench

    bench.description = ("One request at a time, fixed input lengths, every backend; plus a many-request batch, "
                         "build times, the device time of each row (CUDA) and the peak-memory experiment (CUDA "
                         "only; one chunk-sized prefill per capture ceiling).")
    measure_flags(bench, "out/bench")
    bench.add_argument("--backends", type=backend_list, default=None,
                       help="comma list of variants: a backend (eager, breakable, full, tc_piecewise) with "
                       "optional +fused (fused kernels, else plain torch ops) and +inductor or +traced (the layer "
                       "stack compiled by Inductor, or traced by dynamo with no code generated: compile='inductor' "
                       "or 'traced') and, for breakable, +full (its buckets up to 512 tokens also hold a whole-step "
                       "graph with the attention inside: the engine's default on CUDA; without it every bucket "
                       "attends in islands), e.g. breakable+fused (default: "
                       f"{both(','.join(G.backends), ','.join(C.backends))}); plain eager is always measured as "
                       "the baseline")
    bench.add_argument("--lengths", type=int_list("lengths"), default=None,
                       help=f"comma list of input lengths, each at most the model's context (default: "
                       f"{both(','.join(map(str, G.lengths)), ','.join(map(str, C.lengths)))})")
    tc_compiler_flag(bench)
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
    bench.set_defaults(func=run_bench, parser=bench, config="bcg.bench.config:BenchConfig")
