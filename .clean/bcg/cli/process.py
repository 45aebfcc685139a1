"""The process a ``bcg`` run measures in: the CUDA device, the torch threads, the tensor parallel group, and stdout
silenced on every rank but 0; all restored after the run."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator
from typing import Any

from bcg.cli.run import is_main_rank

__all__ = ["process"]


@contextlib.contextmanager
def process(cfg: Any, parser: argparse.ArgumentParser) -> Iterator[None]:
    """Sets the process up for a run of the resolved ``cfg`` and restores it after (a tensor parallel launch without
    torchrun is a usage error of ``parser``).

    Example::

        with process(cfg, parser):
            summary = run_bench(cfg)
    """
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
