"""Differential checks of captured buckets: replay a graph and compare it with eager at the same padded shape.

A graph that replays wrong is the failure users fear most, because nothing crashes. ``verify_buckets`` runs a
seeded two-request batch through every captured bucket twice, once by replaying the handle and once eagerly on the
same static inputs under the same forward context, and compares the real rows. A bucket that differs by more than
the tolerance is disabled with the difference as its reason, so the engine serves those sizes eagerly instead.
Breakable graphs replay the very kernels eager runs, so their default tolerance is zero.

``verify_segments`` says *where* a breakable graph goes wrong (:mod:`bcg.runtime.runner.segments`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from bcg.runtime.batch import PrefillBatch, PrefillItem
from bcg.runtime.runner.segments import SegmentCheck, SegmentReport, compare_segments

if TYPE_CHECKING:
    from bcg.runtime.runner.runner import Runner

__all__ = ["SegmentCheck", "SegmentReport", "default_tolerance", "probe_batch", "verify_buckets", "verify_segments"]

logger = logging.getLogger("bcg")


def default_tolerance(backend: str, dtype: torch.dtype) -> float:
    """Largest accepted max |graph - eager|, relative to max |eager|.

    Breakable replays the eager kernels (0). Full uses a different attention kernel over static metadata and
    tc_piecewise fuses kernels, so they get a rounding allowance of the dtype.
    """
    if backend == "breakable":
        return 0.0
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


@torch.inference_mode()
def verify_buckets(runner: Runner, tolerance: float | None = None, seed: int = 0) -> dict[int, float]:
    """Replays every captured bucket against eager; returns each bucket's max |diff| relative to max |eager|.

    Buckets beyond ``tolerance`` (default: :func:`default_tolerance`) are disabled with the measured difference.

    Example::

        diffs = verify_buckets(engine.runner)     # {4: 0.0, 8: 0.0, ...}
    """
    tol = default_tolerance(runner.config.backend, runner.dtype) if tolerance is None else tolerance
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    diffs: dict[int, float] = {}
    for n in sorted(runner.handles):
        slots = runner.kv_pool.alloc(n)
        try:
            batch = probe_batch(runner, slots, vocab, gen)
            if runner.choose(n, batch)[0] != n:
                continue  # the backend would not replay this batch (e.g. request slots); nothing to compare
            graph_out, eager_out = runner.replay_and_eager(batch)
        finally:
            runner.kv_pool.free(slots)
        scale = eager_out.abs().max().float().clamp_min(1e-12)
        diff = ((graph_out.float() - eager_out.float()).abs().max() / scale).item()
        diffs[n] = diff
        runner.table.record(n).verify_diff = diff
        if not diff <= tol:  # also catches NaN
            runner.table.disable(n, f"verify failed: replay differs from eager by {diff:.3g} (tolerance {tol:.3g})")
    logger.info("bcg: verified %d buckets of %s, worst relative difference %.3g", len(diffs),
                runner.config.backend, max(diffs.values(), default=0.0))
    return diffs


def probe_batch(runner: Runner, slots: torch.Tensor, vocab: int, gen: torch.Generator) -> PrefillBatch:
    """A seeded batch of ``len(slots)`` tokens in the given slots: two requests when possible (request boundaries
    matter), no cached prefix."""
    n = slots.numel()
    ids = torch.randint(0, vocab, (n,), generator=gen)
    cut = max(n // 3, 1) if n > 1 else n
    items = [PrefillItem(ids[:cut], slots[:cut])] + ([PrefillItem(ids[cut:], slots[cut:])] if cut < n else [])
    return PrefillBatch(items, runner.kv_pool)


@torch.inference_mode()
def verify_segments(runner: Runner, num_tokens: int, tolerance: float | None = None, seed: int = 0
                    ) -> SegmentReport:
    """Replays the bucket a batch of ``num_tokens`` tokens uses, step by step, against an eager run at the same
    padded shape, and names the first segment (or island) whose outputs diverge.

    Each island's inputs after the segment before it ran, its outputs after it ran, and the final output are
    compared with the eager run's, which records the same islands (:func:`bcg.recording.record_eager_calls`).
    Handles other than breakable graphs (full, tc_piecewise) are compared on their output only.

    Raises:
        ValueError: a batch of ``num_tokens`` tokens does not replay a graph (the reason is named).

    Example::

        report = verify_segments(engine.runner, 100)
        report.ok, report.first_divergence, report.island_before
        print(report)                         # one line, plus the checks up to the first divergence
    """
    tol = default_tolerance(runner.config.backend, runner.dtype) if tolerance is None else tolerance
    gen = torch.Generator().manual_seed(seed)
    slots = runner.kv_pool.alloc(num_tokens)
    try:
        batch = probe_batch(runner, slots, runner.model.config.vocab_size, gen)
        with runner.replay_context(batch) as (bucket, handle):
            report = compare_segments(runner, handle, bucket, num_tokens, tol)
    finally:
        runner.kv_pool.free(slots)
    return report
