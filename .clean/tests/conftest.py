"""Shared test helpers: an eager prefill driver standing in for the runner; the machine's cached costs kept in a
folder of the test session; no served engine freezes the heap (BCG_GC_FREEZE=0) unless a test asks; the Triton
interpreter's runs started at collection."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from interpreter import start_in_background
from torch import Tensor

from bcg.models.base import CausalLM
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.runtime.batch import PrefillBatch, PrefillItem


@dataclass
class PrefillResult:
    logits: Tensor  # (R, V) fp32, last new token of each request
    hidden: Tensor  # (T_pad, H) output of forward_layers
    slots: list[Tensor]  # per request: all its cached slots (prefix + new), to continue it later
    batch: PrefillBatch


def run_prefill(
    model: CausalLM,
    pool: KVPool,
    chunks: list[tuple[Tensor | None, list[int]]],
    num_padded_tokens: int | None = None,
) -> PrefillResult:
    """Run one packed prefill step eagerly, as the runner would (zeroed padding rows).

    ``chunks`` holds, per request, the slots of its cached prefix (``None`` for none) and its new
    token ids.
    """
    items, slots = [], []
    for prefix_slots, token_ids in chunks:
        prefix_slots = torch.empty(0, dtype=torch.int64) if prefix_slots is None else prefix_slots
        new_slots = pool.alloc(len(token_ids))
        items.append(PrefillItem(token_ids, new_slots, prefix_len=prefix_slots.numel(), prefix_slots=prefix_slots))
        slots.append(torch.cat([prefix_slots, new_slots]))
    batch = PrefillBatch(items, pool)
    num_padded = num_padded_tokens or batch.num_tokens
    weight = model.embed_tokens.weight
    hidden = torch.zeros(num_padded, model.config.hidden_size, dtype=weight.dtype, device=weight.device)
    hidden[: batch.num_tokens] = model.embed(batch.input_ids)
    positions = torch.zeros(num_padded, dtype=torch.int64, device=weight.device)
    positions[: batch.num_tokens] = batch.positions
    with torch.no_grad(), forward_context(batch.to_context(num_padded)):
        hidden = model.forward_layers(hidden, positions)
        logits = model.compute_logits(hidden[batch.logits_indices])
    return PrefillResult(logits, hidden, slots, batch)


@pytest.fixture
def prefill() -> Callable[..., PrefillResult]:
    """The :func:`run_prefill` driver."""
    return run_prefill


@pytest.fixture(scope="session")
def machine_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the machine's cached costs (bcg.bench.machine_cache) for the whole test session."""
    return tmp_path_factory.mktemp("bcg-cache")


@pytest.fixture(autouse=True)
def _machine_cache_in_the_test_session(machine_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bcg analyze` under test neither reads what the user's runs cached in ~/.cache/bcg nor leaves entries there."""
    monkeypatch.setenv("BCG_CACHE_DIR", str(machine_cache_dir))
    # One process builds hundreds of engines here, and a served engine left open would keep the heap frozen for every
    # later test; tests/runtime/runner/test_gc_freeze.py turns the freeze on where it is the subject.
    monkeypatch.setenv("BCG_GC_FREEZE", "0")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the Triton interpreter runs of the selected tests that will not be skipped (tests/interpreter.py)."""
    if session.config.option.collectonly:
        return
    paths = []
    for item in session.items:
        marker = item.get_closest_marker("interpreter")
        if marker is not None and not any(m.args and m.args[0] for m in item.iter_markers("skipif")):
            paths.append(marker.args[0])
    start_in_background(paths)
