"""A compiled engine, once dropped, frees its model and its graphs: dynamo keeps every backend it was given and the
compiled code of every code object for the process's life, so what they reference must not be the engine's."""

from __future__ import annotations

import gc
import weakref

import pytest

from bcg.runtime import Engine
from bcg.runtime.backends.piecewise import GraphedPiece
from bcg.runtime.weak_backend import WeakBackend


def _graphed_pieces() -> int:
    return sum(type(o) is GraphedPiece for o in gc.get_objects())  # type(): no object's __class__ hook runs


@pytest.mark.parametrize("backend, options", [("tc_piecewise", {"tc_compiler": "traced"}),
                                              ("breakable", {"compile": "traced"})])
def test_a_dropped_compiled_engine_frees_its_model_and_its_pieces(backend: str, options: dict) -> None:
    before = _graphed_pieces()

    def build() -> tuple[weakref.ref, weakref.ref, int]:
        eng = Engine("tiny-dense", backend=backend, device="cpu", chunked_prefill_size=16, kv_tokens=64,
                     progress=False, **options)
        eng.prefill([[1, 2, 3, 4, 5]])
        return weakref.ref(eng), weakref.ref(eng.model), _graphed_pieces()

    eng, model, pieces = build()
    gc.collect()
    assert eng() is None and model() is None
    if backend == "tc_piecewise":  # it had graphed pieces, and they went with it
        assert pieces > before
    assert _graphed_pieces() == before


def test_a_weak_backend_forwards_while_its_target_lives_and_says_so_after() -> None:
    class Compiler:
        def __call__(self, gm: object, example_inputs: list) -> str:
            return "compiled"

    target = Compiler()
    backend = WeakBackend(target)
    assert backend("gm", []) == "compiled" and backend.__name__ == "Compiler"
    del target
    gc.collect()
    with pytest.raises(RuntimeError, match="whose engine is gone"):
        backend("gm", [])
