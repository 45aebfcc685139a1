"""The ``bcg`` command: ``bcg bench`` (latency, build and memory of every backend), ``bcg analyze`` (every backend
predicted before capture, and which one to use with which ceiling and buckets), ``bcg verify`` (where a graph
departs from eager) and ``bcg load`` (time to first token under an open-loop load, every backend side by side).

Every flag maps 1:1 to a field of :class:`~bcg.bench.config.BenchConfig`, :class:`~bcg.bench.config.AnalyzeConfig`,
:class:`~bcg.bench.verify_config.VerifyConfig` or :class:`~bcg.bench.load_config.LoadConfig` (``--no-memory`` sets
``memory=False``), and its help shows its default.
Tables go to stdout, progress bars to stderr, and the last line printed is one JSON object summarising the run; the
full results are in ``--out``/results.json next to the PNGs. Under tensor parallel (``torchrun --nproc-per-node N -m
bcg bench --tp N``) every rank measures, and only rank 0 prints and writes files.

This file parses the flags and maps the outcome to an exit status. Only the named command's flags are built (each
command's module: :mod:`.bench`, :mod:`.analyze`, :mod:`.verify`, :mod:`.load`), from torch-free modules
(:mod:`bcg.bench.defaults` and the like); the config class is named, and imported when the run starts. So ``bcg
--help``, ``bcg --version``, a mistyped command, every ``bcg COMMAND --help`` and a bad flag never import torch; the
runs are :mod:`.run`'s, the process set-up :mod:`.process`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

# Nothing heavier than sys at import: the console script imports this module before main() can catch a Ctrl-C.
__all__ = ["COMMANDS", "build_parser", "main"]

# Each subcommand and the module that holds its flags (add_flags) and its one-line help (HELP).
COMMANDS = {"bench": "bcg.cli.bench", "analyze": "bcg.cli.analyze", "verify": "bcg.cli.verify",
            "load": "bcg.cli.load"}


def build_parser(commands: Iterable[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The argparse parser of ``bcg`` (subcommands bench, analyze, verify and load, and ``--version``), with the flags
    of ``commands`` filled in (every command's by default; the others are listed with their help line only).

    Example:
        >>> build_parser([]).parse_args(["load"]).command  # no flags built, nothing heavy imported
        'load'
    """
    import argparse
    import importlib

    from bcg import __version__

    parser = argparse.ArgumentParser(prog="bcg", description="Breakable CUDA graphs for LLM prefill: measure "
                                     "and judge. Without a GPU every graph runs under the CPU emulation; its "
                                     "timings show no kernel-launch overhead.")
    parser.add_argument("--version", action="version", version=_version_line(__version__))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    wanted = set(commands)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)  # flags only, torch-free: their defaults are plain data
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if name in wanted:
            module.add_flags(p)
    return parser


def _version_line(version: str) -> str:
    from importlib import metadata

    try:  # the installed distribution's version, read without importing torch
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"bcg {version} (distribution bcg-prefill; torch {torch_version})"


def _command(args: list[str]) -> str | None:
    """The subcommand named on the command line: the first word that is not an option (``bcg`` has no option that
    takes a value)."""
    return next((a for a in args if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bcg`` console script and ``python -m bcg``; returns the exit status.

    0: measured (verify: no divergence); 1: the run could not measure (e.g. the eager baseline failed to build, or
    no row was measured), or verify found a divergence, one line on stderr; 2: a bad flag, with the usage line and
    one line naming it (nothing has run yet); 130: interrupted (Ctrl-C), one line, whenever it comes (the imports of
    the first seconds included); 141: stdout was closed before the end (``bcg bench | head -1``), quietly.

    Example::

        main(["bench", "--device", "cpu", "--lengths", "16,32", "--runs", "2", "--out", "/tmp/b"])
    """
    args = sys.argv[1:] if argv is None else list(argv)
    command = _command(args)
    name = f"bcg {command}" if command in COMMANDS else "bcg"
    restore = _exit_on_ctrl_c(name)
    try:
        return _run(args, command, restore)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        import os

        # The reader is gone (`| head`): what is left to print has nowhere to go, and Python's flush of stdout at
        # exit would fail again, so stdout becomes /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        restore()


def _exit_on_ctrl_c(name: str) -> Callable[[], None]:
    """Until the returned function is called, Ctrl-C ends the process at once with one line and status 130.

    A KeyboardInterrupt raised while the imports of the first seconds run can land inside a C extension's
    initialiser that swallows it (torch._C importing numpy takes it for a missing numpy and goes on), so the run
    would start anyway; exiting from the handler leaves nothing half done to clean up at that stage. The run itself
    gets Python's KeyboardInterrupt back, so its cleanup (threads, process group) runs.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return lambda: None  # only the main thread may set handlers; an ignored Ctrl-C (nohup, &) stays ignored

    def interrupted(signum: int, frame: object) -> None:
        import os

        sys.stderr.write(f"{name}: interrupted\n")
        sys.stderr.flush()
        os._exit(130)

    previous = signal.signal(signal.SIGINT, interrupted)

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is interrupted:
            signal.signal(signal.SIGINT, previous)

    return restore


def _run(args: list[str], command: str | None, restore: Callable[[], None]) -> int:
    import logging
    import pkgutil
    from dataclasses import fields

    parser = build_parser([command] if command in COMMANDS else [])
    ns = parser.parse_args(args)  # --help, or a bad flag (exit 2), ends here, before torch is imported
    from bcg.bench.checks import check_out_dir
    from bcg.bench.config import BenchError
    from bcg.bench.results import summary_line
    from bcg.cli.process import process

    config = pkgutil.resolve_name(ns.config)  # named by the flags' module, imported only now: it imports torch
    try:
        cfg = config(**{f.name: getattr(ns, f.name) for f in fields(config)}).resolved()
        if hasattr(cfg, "out"):
            check_out_dir(cfg.out)  # before the run: an unwritable folder must not cost its results
    except ValueError as e:
        ns.parser.error(str(e))  # exits 2 with the subcommand's usage line and the message on stderr
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    restore()  # the heavy imports are done: from here Ctrl-C is a KeyboardInterrupt the run cleans up after
    try:
        with process(cfg, ns.parser):
            summary = ns.func(cfg)
            print(summary_line(summary))
    except BenchError as e:
        print(f"bcg {ns.command}: error: {e}", file=sys.stderr)
        return 1
    return 1 if summary.get("ok") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
