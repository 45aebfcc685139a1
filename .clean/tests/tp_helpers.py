"""Shared by the CPU tensor parallel tests (test_tensor_parallel, test_tensor_parallel_failures): the engines'
options and prompts, the rank a function runs on, what each rank reports back, and one process's reference."""

from __future__ import annotations

import os
from typing import Any

from engine_cache import random_prompts

from bcg.runtime import Engine

BUCKETS = [4, 8, 16]
OPTIONS = dict(device="cpu", buckets=BUCKETS, chunked_prefill_size=16, kv_tokens=256, max_requests=4,
               tc_compiler="traced", progress=False, seed=0)
PROMPTS = random_prompts([3, 7, 2], seed=1)  # 12 tokens: bucket 16


def current_rank() -> int:
    """The rank of the process running this (a rank of a RankPool)."""
    return int(os.environ["RANK"])


def summary(eng: Engine, res: Any) -> dict:
    """What a rank sends back of a prefill: logits, tokens, how each batch ran and the engine's bucket table."""
    return {"logits": res.logits.numpy(), "tokens": res.next_tokens.tolist(),
            "batches": [(b.bucket, b.graph_used, b.reason) for b in res.batches],
            "buckets": {n: (r.num_segments, r.num_breaks, r.disabled_reason) for n, r in eng.telemetry.buckets.items()}}


def reference(preset: str, prompts: list[list[int]] = PROMPTS) -> Any:
    """One process's eager prefill of ``prompts``."""
    return Engine(preset, backend="eager", **OPTIONS).prefill(prompts)
