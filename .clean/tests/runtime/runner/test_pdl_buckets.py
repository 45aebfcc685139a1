"""Programmatic dependent launch by forward size: a forward of up to PDL_MAX_TOKENS rows (its capture, replay or eager
run) launches bcg's kernels with it, a larger one without, and anything outside a forward keeps the default. On the
CPU the kernels never launch; what is checked is the choice every launch reads (``pdl_launch``), seen from inside the
model's forward as the engine runs it."""

from __future__ import annotations

from typing import Any

import pytest
from engine_cache import random_prompts

from bcg.ops.kernels import dispatch
from bcg.ops.kernels.dispatch import PDL_MAX_TOKENS, pdl_for, pdl_launch
from bcg.runtime import Engine

OPTS = dict(device="cpu", chunked_prefill_size=256, kv_tokens=1024, progress=False)


def test_pdl_for_sets_the_choice_inside_the_block_only() -> None:
    assert pdl_launch()  # outside any forward: wherever PDL is on
    with pdl_for(PDL_MAX_TOKENS):
        assert pdl_launch()
        with pdl_for(PDL_MAX_TOKENS + 1):
            assert not pdl_launch()
        assert pdl_launch()
    with pytest.raises(RuntimeError), pdl_for(4096):
        assert not pdl_launch()
        raise RuntimeError("a failing forward")
    assert pdl_launch()  # restored on the way out of a failure too


@pytest.mark.parametrize("backend", ["breakable", "eager"])
def test_the_engine_decides_by_the_forwards_size(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine("tiny-dense", backend=backend, buckets=[16, 256], **OPTS)
    seen: list[tuple[int, bool]] = []
    real = eng.runner.step.layers

    def layers(hidden: Any, positions: Any) -> Any:
        seen.append((hidden.shape[0], dispatch.pdl_launch()))
        return real(hidden, positions)

    monkeypatch.setattr(eng.runner.step, "layers", layers)  # the layer stack every path runs
    if backend == "breakable":  # the captures ran before the patch: capture both buckets again under it
        for bucket in (16, 256):
            eng.runner.recapture(bucket)
        assert sorted(set(seen)) == [(16, True), (256, False)]
        seen.clear()
    for lengths in ([10], [200]):
        eng.prefill(random_prompts(lengths))
    if backend == "eager":  # each forward at its own size
        assert seen == [(10, True), (200, False)]
    else:  # replays launch nothing from Python on the CPU: the graphs ran what their captures chose
        assert seen == []
