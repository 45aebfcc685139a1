"""`bcg analyze --validate` measures each backend, never its eager fallback: a compiled variant timed under a torch
thread count other than the one it was compiled with fails dynamo's guard on every replay (tiny-dense, CPU
emulation), and such a timing is reported as a fallback, not as a latency; under ``--cpu-cores`` a compiled variant
is rebuilt pinned, so its guard holds and it replays; the sweep runs a transformers checkpoint by path too."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from bcg.bench.config import AnalyzeConfig
from bcg.bench.engines import EngineSpec, engine_for
from bcg.bench.validate import measure_variants, prompt_for, time_prefills


def _spec() -> EngineSpec:
    cfg = AnalyzeConfig(model="tiny-dense", device="cpu", chunked_prefill_size=32, predict_lengths=[16], length=16,
                        backends=["tc_piecewise"], progress=False).resolved()
    assert cfg.tc_compiler == "traced"
    return cfg.engine_spec()


@pytest.fixture
def two_threads() -> object:
    """torch on two threads during the test (a count the pinned runs then differ from), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_a_timing_that_ran_the_eager_fallback_is_not_the_backends(two_threads: object,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)  # the disabled buckets' warnings are the point here
    with engine_for(_spec(), "tc_piecewise") as eng:
        assert eng is not None
        prompt = prompt_for(eng.model.config.vocab_size, 16, 0)
        timed, fell = time_prefills(eng, {16: prompt}, runs=2, warmup=0)
        assert 16 in timed and not fell  # compiled and replayed under the same thread count
        torch.set_num_threads(1)  # dynamo's guard on the thread count now fails at every replay
        timed, fell = time_prefills(eng, {16: prompt}, runs=2, warmup=0)
        assert 16 not in timed
        assert "ran eagerly instead of replaying" in fell[16] and "eager fallback" in fell[16]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 1, reason="no CPU affinity on this platform")
def test_cpu_cores_rebuild_a_compiled_variant_so_it_replays_pinned(two_threads: object) -> None:
    affinity = os.sched_getaffinity(0)
    got = measure_variants(_spec(), ["tc_piecewise"], [16], 16, runs=2, warmup=0, seed=0, cores=[None, 1])
    m = got["tc_piecewise"]
    assert m.available and m.fallbacks == {}
    assert set(m.ms) == {16} and set(m.by_cores) == {1} and set(m.by_cores[1]) == {16}
    assert m.by_cores[1][16] > 0
    assert torch.get_num_threads() == 2 and os.sched_getaffinity(0) == affinity  # the process as it was


def test_the_cpu_cores_sweep_runs_a_transformers_checkpoint_by_path(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from bcg.cli import main

    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "qwen3-tiny")
    rc = main(["analyze", "--device", "cpu", "--model", str(tmp_path / "qwen3-tiny"), "--model-impl", "transformers",
               "--validate", "--cpu-cores", "1", "--backends", "breakable", "--runs", "2", "--warmup", "0",
               "--no-progress", "--no-plots", "--chunked-prefill-size", "32", "--predict-lengths", "8,16",
               "--length", "16", "--out", str(tmp_path / "out")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["model"]["arch"] == "transformers:qwen3"
    row = data["cpu_cores"]["1"]
    assert set(row["measured"]) == {"eager", "breakable"} and row["fallbacks"] == {}
    assert all(ms > 0 for ms in row["measured"].values()) and row["predictions"]["breakable"] > 0
    assert "The host as a variable: pinned to each core count, at 16 tokens" in capsys.readouterr().out
