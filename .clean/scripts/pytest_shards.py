"""Run one pytest selection as several pytest processes at once, its test files dealt out among them.

The GPU machine's 16 cores sit mostly idle while a test tier compiles Triton kernels and builds engines one after
another; a device session's time is the scarce thing. Collection runs once (``--collect-only`` with the given
arguments); the selected tests are cut into runs of consecutive tests, one per shard, and each shard runs
``pytest ARGS NODE_IDS...`` with ARGS minus the paths. Each shard's output goes to ``LOGS/shard-K.log``; this prints
each shard's summary line and every ``FAILED``/``ERROR`` line, and exits with the first non-zero status of a shard
(0 when all passed). A SIGTERM (a step's time limit) stops every shard.

Shards share the device: tests that size memory by what is free (an engine's default KV pool) see each other's
allocations, so the GPU scripts shard the kernels' own cases by default and the CUDA tier only when asked.

Usage::

    python3 scripts/pytest_shards.py --shards 4 --logs OUT/kernel_tests -- -q -m cuda -rf tests/ops/kernels
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

# pytest's last line: "3 passed, 1 skipped in 2.10s" (with "=" around it unless quiet)
SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b.* in [\d.]+s")


def collect(args: list[str]) -> list[str]:
    """The node ids ``pytest ARGS`` selects, in pytest's order (collected at one ``-q``, whatever ARGS ask)."""
    quiet = [a for a in args if not re.fullmatch(r"-(q+|v+)|--quiet|--verbose", a)]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *quiet], capture_output=True,
                         text=True)
    if out.returncode not in (0, 5):  # 5: nothing selected
        raise SystemExit(f"pytest_shards: collection failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr}")
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def chunk(ids: list[str], shards: int) -> list[list[str]]:
    """``ids`` cut into ``shards`` runs of consecutive tests, as even as can be (a file's cases mostly stay in one
    shard, so the kernels they compile are compiled once); no empty run is returned.

    Example::

        >>> chunk(["a::1", "a::2", "a::3", "b::1", "b::2", "b::3"], 2)
        [['a::1', 'a::2', 'a::3'], ['b::1', 'b::2', 'b::3']]
    """
    n = max(1, min(shards, len(ids)))
    bounds = [round(k * len(ids) / n) for k in range(n + 1)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def is_path(arg: str) -> bool:
    return not arg.startswith("-") and Path(arg.split("::", 1)[0]).exists()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=2, help="pytest processes at once (1: one, as plain pytest)")
    p.add_argument("--logs", type=Path, required=True, help="folder for shard-K.log")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments, paths included")
    args = p.parse_args(argv)
    pytest_args = [a for a in args.pytest_args if a != "--"]
    options = [a for a in pytest_args if not is_path(a)]
    if args.shards <= 1:  # one process: pytest as asked, no collection pass first
        options, groups = [], [list(pytest_args)]
    else:
        groups = chunk(collect(pytest_args), args.shards)
    if not groups:
        print("pytest_shards: no tests selected")
        return 5
    args.logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[Path, Any]] = []

    def stop(*_: object) -> None:  # a time limit: say how far each shard got
        for k, (log, proc) in enumerate(procs):
            proc.terminate()
            last = (log.read_text(errors="replace").strip().splitlines() or ["(nothing yet)"])[-1]
            print(f"shard {k} stopped: {last}")
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    for k, files in enumerate(groups):
        log = args.logs / f"shard-{k}.log"
        with log.open("w") as f:
            procs.append((log, subprocess.Popen([sys.executable, "-m", "pytest", *options, *files], stdout=f,
                                                stderr=subprocess.STDOUT)))
    codes = [proc.wait() for _, proc in procs]
    for k, ((log, _), code) in enumerate(zip(procs, codes)):
        lines = log.read_text(errors="replace").splitlines()
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        summary = next((ln for ln in reversed(lines) if SUMMARY.search(ln)), "(no summary)")
        size = "" if args.shards <= 1 else f" ({len(groups[k])} tests)"
        print(f"shard {k}{size} rc={code}: {summary.strip('= ')}")
        for ln in failed:
            print(f"  {ln}")
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    raise SystemExit(main())
