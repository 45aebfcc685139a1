"""One :meth:`Engine.prefill <bcg.runtime.engine.Engine.prefill>`'s forwards, run inline on the caller's thread, and
their result.

The engine validates the prompts and reserves their KV slots; :func:`run_prefill` then plans each forward with the
one planner (:class:`~bcg.runtime.serving.batcher.Batcher`, over the reservation), runs it through the runner under
its lock and gathers the finished prompts' last-token logits and greedy tokens into a :class:`PrefillResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bcg.runtime.runner.telemetry import BatchRecord
from bcg.runtime.serving.batcher import Batcher, finished_logits
from bcg.runtime.serving.request import Request

if TYPE_CHECKING:
    from bcg.runtime.runner import Runner

__all__ = ["PrefillResult", "run_prefill"]


@dataclass
class PrefillResult:
    """Output of :meth:`Engine.prefill <bcg.runtime.engine.Engine.prefill>`.

    Attributes:
        logits: (num_prompts, vocab) fp32 logits at each prompt's last token.
        next_tokens: (num_prompts,) greedy first output token.
        batches: one record per forward (tokens, requests, bucket replayed or why it ran eagerly).
    """

    logits: torch.Tensor
    next_tokens: torch.Tensor
    batches: list[BatchRecord]


def run_prefill(runner: Runner, ids: list[torch.Tensor], batcher: Batcher) -> PrefillResult:
    """Plans and runs the forwards of ``ids`` on this thread (no prefix cache, first come first served, so every
    tensor-parallel rank plans the same ones) and gathers the last-token logits, which come out in prompt order:
    a prompt never ends before an earlier one.

    Raises:
        RuntimeError: the planner found nothing to run with prompts left (a bug: the reservation covers every chunk).
    """
    for seq, t in enumerate(ids):
        batcher.add(Request(t, None, seq=seq))
    records: list[BatchRecord] = []
    logits: list[torch.Tensor] = []
    next_tokens: list[torch.Tensor] = []
    while batcher.has_work:
        plan = batcher.plan()
        if plan is None:  # the reservation covers every chunk: the planner cannot be blocked here
            raise RuntimeError("prefill's planner found nothing to run with prompts left; report this")
        with runner.lock:  # a replay's logits are a view of the runner's static buffers
            out = runner.forward(plan.batch)
            finished = finished_logits(plan, out.logits)
        records.append(out.record)
        if finished is not None:
            logits.append(finished[0])
            next_tokens.append(finished[1])
        batcher.launched(plan, out.record)
    if len(logits) == 1:  # the common case: every prompt ended in one forward
        return PrefillResult(logits[0], next_tokens[0], records)
    return PrefillResult(torch.cat(logits), torch.cat(next_tokens), records)
