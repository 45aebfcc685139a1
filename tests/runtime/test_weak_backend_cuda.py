"""On a GPU, a dropped compiled engine gives back its device memory: its weights, its pool and its graphs (dynamo
keeps backends and compiled code for the process's life; see bcg.runtime.weak_backend)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from bcg.runtime import Engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend, options", [("tc_piecewise", {"tc_compiler": "inductor"}),
                                              ("breakable", {"compile": "inductor"})])
def test_a_dropped_compiled_engine_gives_back_its_device_memory(backend: str, options: dict) -> None:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def build() -> tuple[weakref.ref, int]:
        eng = Engine("tiny-dense", backend=backend, device="cuda", chunked_prefill_size=64, kv_tokens=4096,
                     progress=False, **options)
        eng.prefill([list(range(1, 40))])
        torch.cuda.synchronize()
        return weakref.ref(eng.model), torch.cuda.memory_allocated()

    model, held = build()
    gc.collect()
    torch.cuda.synchronize()
    assert model() is None
    assert held > before  # the engine held memory: weights, pool, graphs' outputs
    assert torch.cuda.memory_allocated() - before < 0.05 * (held - before), (before, held)
