"""The flags of ``bcg verify``: replay captured buckets segment by segment against eager and name the first
divergence.

Each flag maps 1:1 to a field of :class:`~bcg.bench.verify_config.VerifyConfig`: the engine's
(:class:`~bcg.runtime.config.EngineConfig` fields of the same names), ``--num-tokens`` and ``--tolerance`` (the
arguments of :func:`~bcg.runtime.runner.verify.verify_segments`). The capture runs with the leak detector on
(``--leak-check``, :mod:`bcg.leaks`). One report per batch size goes to stdout, then one JSON summary line
(:func:`bcg.cli.run.run_verify`); the exit status is 1 when any bucket diverges (or no batch size replays a graph),
0 otherwise.
"""

from __future__ import annotations

import argparse

from bcg.cli.flags import engine_flags, int_list, tc_compiler_flag

__all__ = ["add_flags"]

HELP = "replay graphs segment by segment against eager; name the first divergence"


def add_flags(p: argparse.ArgumentParser) -> None:
    """Fills in the ``verify`` subcommand's parser (:class:`~bcg.bench.verify_config.VerifyConfig`, one flag per
    field)."""
    from bcg.cli.run import run_verify
    from bcg.runtime.backend_registry import BACKENDS

    p.description = ("Builds an engine, then for each batch size replays the bucket it uses step by step against an "
                     "eager run at the same padded shape and names the first segment (and the island before it) "
                     "whose outputs diverge. Exits 1 on divergence.")
    engine_flags(p, "%(default)s on every machine", model="tiny-dense")
    p.add_argument("--backend", default="breakable", choices=[b for b in BACKENDS if b != "eager"],
                   help="breakable (segment by segment), full or tc_piecewise (output only) (default: %(default)s)")
    p.add_argument("--buckets", type=int_list("buckets"), default=None,
                   help="comma list of buckets to capture (default: the ladder up to --max-tokens)")
    p.add_argument("--max-tokens", type=int, default=None, help="capture ceiling (default: the chunk size)")
    tc_compiler_flag(p)
    p.add_argument("--max-requests", type=int, default=None,
                   help="request slots of the full backend's graphs (default: one per 512 tokens of the chunk, at "
                   "least 2: each size is checked with a batch of 2 requests)")
    p.add_argument("--num-tokens", type=int_list("num-tokens"), default=None,
                   help="comma list of batch sizes to check (default: every captured bucket, full)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative difference accepted, >= 0 (default: 0 for breakable, a rounding "
                   "allowance for the others)")
    p.add_argument("--leak-check", choices=("off", "warn", "raise"), default="warn",
                   help="report tensors an island keeps without returning them, at capture (default: %(default)s)")
    p.set_defaults(func=run_verify, parser=p, config="bcg.bench.verify_config:VerifyConfig")
