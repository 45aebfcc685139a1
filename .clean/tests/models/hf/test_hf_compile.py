"""compile= on transformers models: one trace per distinct layer structure whatever the depth, the same breaks and
numbers as uncompiled, and a model dynamo cannot trace refused in one line."""

from __future__ import annotations

import re

import pytest
import torch
from engine_cache import max_diff
from hf_cases import expected, make_model, one_thread, prompts

from bcg.runtime import Engine

SMALL = dict(device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def _compiled(model, **kw) -> Engine:
    eng = Engine(model, backend="breakable", compile="traced", **{**SMALL, **kw})
    assert eng.telemetry.compile_error is None, eng.telemetry.compile_error
    return eng


def test_layers_compile_once_per_structure_whatever_the_depth():
    assert [_compiled(make_model("llama", num_hidden_layers=n)).runner.step.layers.num_graphs for n in (2, 6)] == [1, 1]
    # gemma2 alternates sliding and full attention layers: two structures.
    gemma2 = make_model("gemma2", num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    assert _compiled(gemma2).runner.step.layers.num_graphs == 2


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3_text"])
def test_compiled_layers_break_at_their_islands_and_match_transformers(arch):
    eng, plain = _compiled(make_model(arch)), Engine(make_model(arch), backend="breakable", **SMALL)
    assert eng.telemetry.buckets[32].num_breaks == plain.telemetry.buckets[32].num_breaks == eng.model.config.num_layers
    res = eng.prefill(prompts())
    assert all(b.graph_used for b in res.batches)
    assert max_diff(res.logits, expected(arch)) <= 1e-4 and torch.equal(res.next_tokens, expected(arch).argmax(-1))


def test_a_layer_that_calls_an_island_dynamo_cannot_trace_is_refused_in_one_line():
    eng = Engine(make_model("deepseek_v32"), backend="breakable", compile="traced", **SMALL)
    assert re.fullmatch(
        r"compile='traced' failed: CompileRefused: torch.compile cannot trace DeepseekV32DecoderLayer, layer 0 at "
        r"deepseek_v32/modeling_deepseek_v32.py:\d+ \(forward\): it calls an @eager_on_graph island that is not "
        r"one of bcg's custom ops \(dynamo cannot trace an island's wrapper\). Fix: run without compile= \(the "
        r"engine now serves the uncompiled layer stack, graphs included\); BCG_COMPILE_LOG=1 shows dynamo's log of "
        r"the attempt",
        eng.telemetry.compile_error), eng.telemetry.compile_error
    res = eng.prefill(prompts())  # served by the uncompiled stack, graphs included
    assert all(b.graph_used for b in res.batches) and max_diff(res.logits, expected("deepseek_v32")) <= 1e-4
