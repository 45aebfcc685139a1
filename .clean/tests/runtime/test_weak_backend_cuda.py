"""On a GPU, a dropped Inductor-compiled engine gives back its model's weights (dynamo keeps backends and compiled code
for the process's life; see bcg.runtime.weak_backend). What it does not yet give back, measured on the H200: about the
size of its KV pool (67 of 69 MB for tiny-dense with 4096 KV tokens), held after the model is gone; the traced
compile on a CPU frees everything (tests/runtime/test_weak_backend.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from bcg.runtime import Engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend, options", [("tc_piecewise", {"tc_compiler": "inductor"}),
                                              ("breakable", {"compile": "inductor"})])
def test_a_dropped_compiled_engine_gives_back_its_weights(backend: str, options: dict) -> None:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def build() -> tuple[weakref.ref, int, int]:
        eng = Engine("tiny-dense", backend=backend, device="cuda", chunked_prefill_size=64, kv_tokens=4096,
                     progress=False, **options)
        eng.prefill([list(range(1, 40))])
        torch.cuda.synchronize()
        weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        return weakref.ref(eng.model), torch.cuda.memory_allocated(), weights

    model, held, weights = build()
    gc.collect()
    torch.cuda.synchronize()
    assert model() is None and held > before + weights
    assert held - torch.cuda.memory_allocated() >= weights, (before, held, weights)
