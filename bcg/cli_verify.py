"""``bcg verify``: replay captured buckets segment by segment against eager and name the first divergence.

Engine flags map 1:1 to :class:`~bcg.runtime.config.EngineConfig` fields (``--chunked-prefill-size`` sets
``chunked_prefill_size``); ``--num-tokens`` and ``--tolerance`` are the arguments of
:func:`~bcg.runtime.runner.verify.verify_segments`. The capture runs with the leak detector on (``--leak-check``,
:mod:`bcg.leaks`). One report per batch size goes to stdout, then one JSON summary line; the exit status is 1 when
any bucket diverges (or no batch size replays a graph), 0 otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]

_ENGINE_FLAGS = ("backend", "device", "dtype", "seed", "buckets", "max_tokens", "chunked_prefill_size",
                 "tc_compiler", "progress", "leak_check")


def add_parser(sub: Any, int_list: Any) -> argparse.ArgumentParser:
    """Adds the ``verify`` subcommand to ``sub`` (argparse subparsers); ``int_list(name)`` parses comma lists."""
    p = sub.add_parser("verify", help="replay graphs segment by segment against eager; name the first divergence",
                       description="Builds an engine, then for each batch size replays the bucket it uses step by "
                       "step against an eager run at the same padded shape and names the first segment (and the "
                       "island before it) whose outputs diverge. Exits 1 on divergence.")
    p.add_argument("--model", default="tiny-dense", help="preset name or checkpoint folder (default tiny-dense)")
    p.add_argument("--backend", default="breakable", help="breakable (segment by segment), full or tc_piecewise "
                   "(output only)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and the probe batch")
    p.add_argument("--buckets", type=int_list("buckets"), default=None, help="comma list of buckets to capture")
    p.add_argument("--max-tokens", type=int, default=None, help="capture ceiling (default: the chunk size)")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="tokens per forward")
    p.add_argument("--tc-compiler", default="inductor", help="inductor or eager (tc_piecewise)")
    p.add_argument("--num-tokens", type=int_list("num-tokens"), default=None,
                   help="comma list of batch sizes to check (default: every captured bucket, full)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative difference accepted (default: 0 for breakable, a rounding allowance else)")
    p.add_argument("--leak-check", choices=("off", "warn", "raise"), default="warn",
                   help="report tensors an island keeps without returning them, at capture (default warn)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    p.set_defaults(parser=p)
    return p


def run(ns: argparse.Namespace) -> int:
    """Runs ``bcg verify`` for parsed arguments ``ns``; returns the exit status."""
    from bcg.bench.checks import check_model
    from bcg.bench.report import summary_line
    from bcg.runtime import Engine, EngineConfig
    from bcg.runtime.runner.verify import verify_segments

    try:
        config = EngineConfig(**{name: getattr(ns, name) for name in _ENGINE_FLAGS})
    except (TypeError, ValueError) as e:
        ns.parser.error(str(e))
    try:
        check_model(ns.model)
    except ValueError as e:
        ns.parser.error(str(e))
    engine = Engine(ns.model, config)
    sizes = ns.num_tokens or sorted(engine.runner.handles)
    reports, skipped = [], {}
    for n in sizes:
        try:
            report = verify_segments(engine.runner, n, ns.tolerance, ns.seed)
        except ValueError as e:  # this size runs eagerly: nothing to compare
            skipped[n] = str(e)
            print(f"{n} tokens: skipped, {e}")
            continue
        reports.append(report)
        print(report)
    ok = bool(reports) and all(r.ok for r in reports)
    print(summary_line({"kind": "verify", "model": str(ns.model), "backend": config.backend, "ok": ok,
                        "buckets": sorted({r.bucket for r in reports}), "skipped": skipped,
                        "max_diff": max((r.max_diff for r in reports), default=None),
                        "first_divergence": {str(r.bucket): r.to_dict()["first_divergence"]
                                             for r in reports if not r.ok}}))
    return 0 if ok else 1
