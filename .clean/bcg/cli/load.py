"""The flags of ``bcg load``: time to first token under an open-loop load, every backend side by side.

Each flag maps 1:1 to a field of :class:`~bcg.bench.load_config.LoadConfig`; the run is :func:`bcg.cli.run.run_load`.
"""

from __future__ import annotations

import argparse

from bcg.cli.flags import backend_list, both, engine_flags, float_list, out_dir, tc_compiler_flag

__all__ = ["add_flags"]

HELP = "time to first token and throughput under an open-loop load"


def add_flags(load: argparse.ArgumentParser) -> None:
    """Fills in the ``load`` subcommand's parser (:class:`~bcg.bench.load_config.LoadConfig`, one flag per field)."""
    from bcg.bench.defaults import CPU_DEFAULTS as C
    from bcg.bench.defaults import CUDA_DEFAULTS as G
    from bcg.bench.defaults import LOAD_CPU_DEFAULTS as LC
    from bcg.bench.defaults import LOAD_CUDA_DEFAULTS as LG
    from bcg.cli.run import run_load
    from bcg.runtime.schedule_policies import SCHEDULE_POLICIES

    load.description = ("Poisson arrivals at each offered rate (or a trace) through Engine.submit, every backend "
                        "in turn on the same requests: TTFT p50/p90/p99, queueing time and tokens/s per backend and "
                        "rate, a PNG of TTFT against offered load. A backend that falls behind a rate stops there and "
                        "skips its higher rates. On the CPU it is a smoke test.")
    engine_flags(load, both(G.model, C.model))  # resolve_machine's model, as for bench
    rates = ",".join(f"{r:g}" for r in LG.rates), ",".join(f"{r:g}" for r in LC.rates)
    variants = ",".join(LG.backends), ",".join(LC.backends)
    load.add_argument("--backends", type=backend_list, default=None,
                      help=f"comma list of variants as in bench (default: {both(*variants)})")
    load.add_argument("--rates", type=float_list, default=None,
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
    tc_compiler_flag(load)
    load.add_argument("--out", type=out_dir, default="out/load", help="output folder for results.json and load.png "
                      "(default: %(default)s)")
    load.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: torch's own on CUDA, 1 on the CPU)")
    load.add_argument("--no-plots", dest="plots", action="store_false",
                      help="skip load.png, and remove that of an earlier run in --out (default: draw it)")
    load.set_defaults(func=run_load, parser=load, config="bcg.bench.load_config:LoadConfig")
